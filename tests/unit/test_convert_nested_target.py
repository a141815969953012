"""The target a drafter is checked against, read as transformers and vLLM read it: the target configs here are
serialized by transformers' own config classes for the Qwen3 family (the installed transformers, the one vLLM
uses), so their shape is transformers', not the converter's. Qwen3 and Qwen3-Next keep their sizes at the top
level; Qwen3.5 (Qwen3_5ForConditionalGeneration, also Qwen3.8's shape), Qwen3.5-MoE and Qwen3-VL under
text_config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from transformers import AutoConfig

from b70ctl.errors import BadInput
from b70ctl.models.convert import convert, target_text_config
from store_fixtures import drafter_files

# The drafter fixture drafts for vocab 1024, hidden 64, reading target layers [1, 3, 5].
SIZES = {"vocab_size": 1024, "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "head_dim": 16}

# (transformers class, architecture as the hub's config.json names it, sizes nested under text_config?)
QWEN3_FAMILY = [
    ("Qwen3Config", "Qwen3ForCausalLM", False),
    ("Qwen3NextConfig", "Qwen3NextForCausalLM", False),
    ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", True),
    ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", True),
    ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", True),
]


def _save_target(directory: Path, class_name: str, architecture: str, nested: bool, **sizes: int) -> Path:
    config_class = getattr(transformers, class_name)
    values = SIZES | sizes
    if nested:
        config = config_class(text_config=values | {"moe_intermediate_size": 32}, architectures=[architecture])
    else:
        config = config_class(**values, architectures=[architecture])
    config.save_pretrained(directory)
    return directory


def _write_drafter(directory: Path) -> Path:
    directory.mkdir(parents=True)
    for name, data in drafter_files().items():
        (directory / name).write_bytes(data)
    return directory


@pytest.mark.parametrize(("class_name", "architecture", "nested"), QWEN3_FAMILY)
def test_target_sizes_are_the_ones_transformers_reads(tmp_path, class_name, architecture, nested):
    target = _save_target(tmp_path / "target", class_name, architecture, nested)
    saved = json.loads((target / "config.json").read_text())
    # The class really wrote the shape this case is about (else the case tests nothing).
    assert ("text_config" in saved) is nested
    assert ("vocab_size" in saved) is not nested

    ours = target_text_config(saved)
    theirs = AutoConfig.from_pretrained(target).get_text_config()
    assert {name: ours.get(name) for name in ("vocab_size", "num_hidden_layers", "hidden_size")} == {
        "vocab_size": theirs.vocab_size, "num_hidden_layers": theirs.num_hidden_layers,
        "hidden_size": theirs.hidden_size}
    assert theirs.vocab_size == 1024  # our sizes went in, not the class's defaults


@pytest.mark.parametrize(("class_name", "architecture", "nested"), QWEN3_FAMILY)
def test_drafter_converts_against_every_qwen3_target_shape(tmp_path, class_name, architecture, nested):
    target = _save_target(tmp_path / "target", class_name, architecture, nested)
    drafter = _write_drafter(tmp_path / "drafter")
    result = convert(drafter, tmp_path / "drafter-vllm", "0.32.0", target)
    assert result["changed"] is True
    assert json.loads((tmp_path / "drafter-vllm" / "config.json").read_text())["architectures"] == [
        "Qwen3DSparkModel"]


@pytest.mark.parametrize(("sizes", "message"), [
    ({"vocab_size": 248320},
     "drafter config.json vocab_size: 1024 does not match the target's vocab_size 248320: this drafter was trained "
     "for another model"),
    ({"num_hidden_layers": 4},
     "drafter config.json target_layer_ids: [1, 3, 5] reach outside the target's 4 layers (0..3)"),
    ({"hidden_size": 5120},
     "drafter config.json hidden_size: the drafter reads target hidden states of size 64, the target's hidden_size "
     "is 5120: this drafter was trained for another model"),
])
def test_nested_target_sizes_are_checked_not_skipped(tmp_path, sizes, message):
    target = _save_target(tmp_path / "target", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration", True, **sizes)
    drafter = _write_drafter(tmp_path / "drafter")
    with pytest.raises(BadInput) as error:
        convert(drafter, tmp_path / "out", "0.32.0", target)
    assert str(error.value) == message


@pytest.mark.parametrize(("config", "message"), [
    ({"text_config": {"vocab_size": 1024}, "decoder": {"num_attention_heads": 4}},
     "target config.json: several text configs (decoder, text_config): vLLM cannot tell which one is the language "
     "model"),
    ({"text_config": {"vocab_size": 1024, "hidden_size": 64, "num_hidden_layers": 8}},
     "target config.json text_config: no num_attention_heads, so vLLM would refuse it as the text config"),
    ({"text_config": "qwen3"}, "target config.json text_config: expected an object, found 'qwen3'"),
])
def test_text_configs_vllm_refuses_are_refused(config, message):
    with pytest.raises(BadInput) as error:
        target_text_config(config)
    assert str(error.value) == message


def test_a_null_text_config_means_the_top_level(tmp_path):
    # transformers skips a sub-config that is set to None; so must we.
    config = {"text_config": None, "vision_config": {"hidden_size": 3}} | SIZES
    assert target_text_config(config) is config
