"""Drafter conversion: rename + hoist + validate, weights hard-linked, provenance, idempotence, one-line failures
naming the field; and vLLM 0.32.0's own config code resolving the result to Qwen3DSparkForCausalLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from b70ctl.errors import BadInput
from b70ctl.models.convert import PROVENANCE_FILE, convert, converted_config
from store_fixtures import drafter_config, drafter_files, sha256, target_files

B70CTL = str(Path(sys.executable).with_name("b70ctl"))


def _write_model(directory: Path, files: dict[str, bytes]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return directory


@pytest.fixture
def models(tmp_path) -> tuple[Path, Path]:
    """(drafter as SpecForge ships it, target)."""
    drafter = _write_model(tmp_path / "downloaded" / "drafter", drafter_files())
    target = _write_model(tmp_path / "downloaded" / "target", target_files())
    return drafter, target


def _config(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "config.json").read_text())


def test_convert_renames_hoists_links_and_records_provenance(models, tmp_path):
    src, target = models
    source_config_bytes = (src / "config.json").read_bytes()
    dst = tmp_path / "downloaded" / "drafter-vllm"
    result = convert(src, dst, "0.29.0", target, source_revision="a" * 40)
    assert result["changed"] is True

    config = _config(dst)
    assert config["architectures"] == ["Qwen3DSparkModel"]
    assert (config["markov_rank"], config["enable_confidence_head"], config["confidence_head_with_markov"]) == (
        16, True, True)
    # vLLM reads target_layer_ids / mask_token_id from dflash_config first: they stay there.
    assert config["dflash_config"] == {"target_layer_ids": [1, 3, 5], "mask_token_id": 1000}
    assert config["block_size"] == 7 and config["vocab_size"] == 1024
    # Weights: the same inode, so byte-identical and no copy.
    assert os.path.samefile(src / "model.safetensors", dst / "model.safetensors")
    assert (src / "config.json").read_bytes() == source_config_bytes  # the source stays as locked

    provenance = json.loads((dst / PROVENANCE_FILE).read_text())
    assert provenance["source_revision"] == "a" * 40
    assert provenance["vllm_version"] == "0.29.0"
    assert provenance["source_files"]["model.safetensors"]["sha256"] == sha256(drafter_files()["model.safetensors"])
    assert provenance["source_files"]["config.json"]["sha256"] == sha256(source_config_bytes)
    assert provenance["changes"] == [
        "architectures: DSparkDraftModel -> Qwen3DSparkModel (vLLM 0.29.0 maps DSparkDraftModel to the DeepSeek-V4 "
        "DSpark class)",
        "dflash_config.markov_rank -> markov_rank (vLLM reads it from the top level only)",
        "dflash_config.enable_confidence_head -> enable_confidence_head (vLLM reads it from the top level only)",
        "dflash_config.confidence_head_with_markov -> confidence_head_with_markov (vLLM reads it from the top "
        "level only)",
    ]
    assert provenance["config_sha256"] == sha256((dst / "config.json").read_bytes())

    before = {p.name: p.stat().st_mtime_ns for p in dst.iterdir()}
    again = convert(src, dst, "0.29.0", target, source_revision="a" * 40)
    assert again["changed"] is False
    assert {p.name: p.stat().st_mtime_ns for p in dst.iterdir()} == before


def test_convert_for_another_version_or_changed_source_rewrites(models, tmp_path):
    src, target = models
    dst = tmp_path / "downloaded" / "drafter-vllm"
    convert(src, dst, "0.26.0", target)
    assert convert(src, dst, "0.32.0", target)["changed"] is True
    assert json.loads((dst / PROVENANCE_FILE).read_text())["vllm_version"] == "0.32.0"
    (src / "model.safetensors").unlink()  # a re-fetch replaced the weights: new inode
    (src / "model.safetensors").write_bytes(drafter_files(seed=5)["model.safetensors"])
    assert convert(src, dst, "0.32.0", target)["changed"] is True
    assert os.path.samefile(src / "model.safetensors", dst / "model.safetensors")
    assert not (tmp_path / "downloaded" / "drafter-vllm.retired").exists()


def test_dspark_config_fields_vllm_never_reads_there_are_all_hoisted():
    config = drafter_config(block_size=None)
    del config["block_size"]
    config["dspark_config"] = config.pop("dflash_config") | {"block_size": 7, "use_aux_hidden_state": True}
    converted, changes = converted_config(config, "0.25.0")
    assert "dspark_config" not in converted
    assert (converted["target_layer_ids"], converted["mask_token_id"], converted["block_size"],
            converted["markov_rank"], converted["use_aux_hidden_state"]) == ([1, 3, 5], 1000, 7, 16, True)
    assert changes[-1] == "removed the empty dspark_config"


def test_already_native_config_is_left_as_is():
    config, _ = converted_config(drafter_config(), "0.29.0")
    again, changes = converted_config(config, "0.29.0")
    assert again == config and changes == []


@pytest.mark.parametrize(("change", "message"), [
    ({"architectures": ["LlamaForCausalLM"]},
     "drafter config.json architectures: unknown architecture 'LlamaForCausalLM': expected one of DSparkDraftModel, "
     "Qwen3DSparkModel (a Qwen3 DSpark drafter)"),
    ({"vocab_size": 151936},
     "drafter config.json vocab_size: 151936 does not match the target's vocab_size 1024: this drafter was trained "
     "for another model"),
    ({"dflash_config": {"mask_token_id": 1000, "markov_rank": 16}},
     "drafter config.json target_layer_ids: missing (top level or dflash_config): the drafter cannot know which "
     "target layers to read"),
    ({"dflash_config": {"target_layer_ids": [1, 3, 9], "mask_token_id": 1000, "markov_rank": 16}},
     "drafter config.json target_layer_ids: [1, 3, 9] reach outside the target's 8 layers (0..7)"),
    ({"dflash_config": {"target_layer_ids": [1, 3, 5], "mask_token_id": 4096, "markov_rank": 16}},
     "drafter config.json mask_token_id: 4096 is outside the vocabulary (0..1023)"),
    ({"dflash_config": {"target_layer_ids": [1, 3, 5], "mask_token_id": 1000}},
     "drafter config.json markov_rank: missing or not a positive integer (None): vLLM reads it top-level"),
    ({"markov_rank": 32},
     "drafter config.json markov_rank: top level says 32 but dflash_config.markov_rank says 16: fix the drafter's "
     "config so they agree"),
    ({"target_hidden_size": 5120},
     "drafter config.json target_hidden_size: the drafter reads target hidden states of size 5120, the target's "
     "hidden_size is 64: this drafter was trained for another model"),
    ({"model_type": "llama"},
     "drafter config.json model_type: 'llama': Qwen3DSparkForCausalLM is a qwen3 drafter"),
])
def test_unconvertible_configs_fail_naming_the_field(models, tmp_path, change, message):
    src, target = models
    (src / "config.json").write_text(json.dumps(drafter_config(**change)))
    dst = tmp_path / "out"
    with pytest.raises(BadInput) as error:
        convert(src, dst, "0.29.0", target)
    assert str(error.value) == message
    assert not dst.exists()  # nothing half-written
    assert not list(tmp_path.glob("out.*"))


def test_versions_without_native_dspark_are_refused(models, tmp_path):
    src, target = models
    with pytest.raises(BadInput, match=r"vLLM 0.21.1.dev0 has no native DSpark"):
        convert(src, tmp_path / "out", "0.21.1.dev0", target)


def test_cli_takes_the_version_from_the_recipe_and_exits_2_on_bad_input(models, tmp_path):
    src, target = models
    dst = tmp_path / "downloaded" / "converted"
    # No --target: the fetch layout puts it beside the drafter (DEST/target, DEST/drafter).
    done = subprocess.run([B70CTL, "model", "convert", str(src), str(dst), "--recipe", "dspark-int4-tp1", "--json"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["vllm_version"] == "0.29.0"
    assert _config(dst)["architectures"] == ["Qwen3DSparkModel"]
    (src / "config.json").write_text(json.dumps(drafter_config(vocab_size=2048)))
    bad = subprocess.run([B70CTL, "model", "convert", str(src), str(tmp_path / "x"), "--target", str(target),
                          "--vllm-version", "0.30.0"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip() == ("error: drafter config.json vocab_size: 2048 does not match the target's vocab_size "
                                  "1024: this drafter was trained for another model")


VLLM_PROOF = r"""
import json, sys
from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
from vllm.model_executor.models.registry import ModelRegistry

target_dir, converted_dir, original_dir = sys.argv[1:4]
target = ModelConfig(model=target_dir, tokenizer=None, skip_tokenizer_init=True, dtype="float32")

def draft(directory):
    spec = SpeculativeConfig(method="dspark", model=directory, num_speculative_tokens=7,
                             target_model_config=target, target_parallel_config=ParallelConfig())
    hf = spec.draft_model_config.hf_config
    model_cls, arch = ModelRegistry.resolve_model_cls(spec.draft_model_config.architectures,
                                                      spec.draft_model_config)
    return {"arch": arch, "class": f"{model_cls.__module__}.{model_cls.__name__}",
            "markov_rank": getattr(hf, "markov_rank", None),
            "enable_confidence_head": getattr(hf, "enable_confidence_head", False),
            "confidence_head_with_markov": getattr(hf, "confidence_head_with_markov", False),
            "num_speculative_tokens": spec.num_speculative_tokens}

print(json.dumps({
    "converted": draft(converted_dir),
    "original": draft(original_dir),
    "registry_DSparkDraftModel": ModelRegistry.models["DSparkDraftModel"].class_name,
}))
"""


def test_vllm_resolves_the_converted_drafter_to_qwen3_dspark(models, tmp_path):
    """vLLM 0.32.0's own SpeculativeConfig + ModelRegistry (the path `vllm serve --speculative-config` takes),
    run on the converted and the original config: only the converted one gives the heads their settings."""
    src, target = models
    dst = tmp_path / "downloaded" / "drafter-vllm"
    convert(src, dst, "0.32.0", target)
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="ERROR")
    done = subprocess.run([sys.executable, "-c", VLLM_PROOF, str(target), str(dst), str(src)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["converted"] == {
        "arch": "Qwen3DSparkModel",
        "class": "vllm.model_executor.models.qwen3_dspark.Qwen3DSparkForCausalLM",
        "markov_rank": 16, "enable_confidence_head": True, "confidence_head_with_markov": True,
        "num_speculative_tokens": 7,
    }
    # Unconverted, 0.32 renames the architecture itself (>= 0.29) but the nested fields are invisible to the
    # model: markov_rank missing (AttributeError at load) and the confidence head silently off.
    assert found["original"]["class"] == "vllm.model_executor.models.qwen3_dspark.Qwen3DSparkForCausalLM"
    assert found["original"]["markov_rank"] is None
    assert found["original"]["enable_confidence_head"] is False
    # And on 0.25-0.28, which do not rename, DSparkDraftModel is the DeepSeek-V4 class: why we always rename.
    assert found["registry_DSparkDraftModel"] == "DSparkDeepseekV4ForCausalLM"


# vllm-project/vllm PR #41834 (https://github.com/vllm-project/vllm/pull/41834), as docs/facts.md reports it:
# "num_speculative_tokens above the drafter's block size collapses acceptance (k=7 on a block-5 drafter: 4.4%,
# k=5: 34.7%)". dspark-int4-tp1 serves k=7 and tunes k 4..7 (docs/facts.md, Doopeworld recipe).
def test_convert_with_a_recipe_refuses_a_drafter_whose_block_is_below_the_recipes_k(models, tmp_path):
    src, _target = models
    (src / "config.json").write_text(json.dumps(drafter_config(block_size=5)))
    done = subprocess.run([B70CTL, "model", "convert", str(src), str(tmp_path / "out"), "--recipe",
                           "dspark-int4-tp1"], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "error: drafter config.json block_size: 5, recipe dspark-int4-tp1 declares drafter.block_size 7: this is "
        "not the drafter the recipe was written for; fetch the recipe's drafter or fix drafter.block_size")
    assert not (tmp_path / "out").exists()


def test_convert_refuses_k_a_recipe_tunes_above_the_block(models, tmp_path):
    from b70ctl.recipes import load_recipe

    src, target = models
    (src / "config.json").write_text(json.dumps(drafter_config(block_size=6)))
    recipe = load_recipe("dspark-int4-tp1")
    # The recipe without its own declaration: the tune's k range 4..7 still reaches past a block of 6.
    undeclared = recipe.model_copy(update={"drafter": recipe.drafter.model_copy(update={"block_size": None})})
    with pytest.raises(BadInput) as error:
        convert(src, tmp_path / "out", "0.29.0", target, recipe=undeclared)
    assert str(error.value) == (
        "drafter config.json block_size: 6, recipe dspark-int4-tp1 serves or tunes num_speculative_tokens up to 7: "
        "acceptance collapses past the block (vllm PR #41834); lower num_speculative_tokens (and tune's range) to "
        "<= 6")


def test_convert_accepts_the_recipes_drafter_block(models, tmp_path):
    src, target = models
    from b70ctl.recipes import load_recipe

    result = convert(src, tmp_path / "out", "0.29.0", target, recipe=load_recipe("dspark-int4-tp1"))
    assert result["changed"] and _config(tmp_path / "out")["block_size"] == 7
