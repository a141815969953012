"""Recipes: the shipped ones validate, bad ones are refused with the field and the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from b70ctl.errors import BadInput
from b70ctl.recipes import load_recipe, load_recipe_file, recipe_names, recipe_path
from b70ctl.recipes.model import Claim


def test_shipped_recipes_load():
    assert recipe_names() == ["cpu-tiny", "cpu-tiny-ngram", "cpu-tiny-target-only",
                              "dspark-fp8-tp2", "dspark-int4-tp1", "mtp3-int4-tp2", "mtp4-int4-tp1",
                              "mtp8-fp8-tp2", "pr620-fp8-tp2"]
    pr620 = load_recipe("pr620-fp8-tp2")
    assert pr620.serve.tensor_parallel_size == 2
    assert pr620.serve.speculative.method == "dflash"
    assert pr620.serve.speculative.num_speculative_tokens == 4
    assert pr620.serve.dtype == "bfloat16"
    claims = {c.id: c for c in pr620.claims}
    assert claims["short-median"].value == 72.2
    assert claims["short-peak"].value == 85.9
    native = load_recipe("dspark-int4-tp1")
    assert native.serve.speculative.method == "dspark"
    assert native.serve.speculative.num_speculative_tokens == 7
    assert native.serve.speculative.draft_sample_method == "probabilistic"
    per_position = {c.id: c for c in native.claims}["per-position-acceptance"]
    assert per_position.values == [0.76, 0.45, 0.31, 0.14, 0.10, 0.02, 0.00]
    # TP=2 on vLLM CPU beside a TP=1 target-only baseline (docs/facts.md, "Added after the first release"), with no GPU.
    tiny = load_recipe("cpu-tiny")
    assert (tiny.serve.tensor_parallel_size, tiny.serve.baseline_tensor_parallel_size) == (2, 1)
    assert tiny.host.gpu_count == 0 and tiny.host.cpu_cores_min == 2


def _variant(tmp_path: Path, name: str, edit) -> Path:
    data = yaml.safe_load(recipe_path(name).read_text())
    edit(data)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("dspark-int4-tp1", lambda d: d.update(vllm_version="0.21.0"), "needs vLLM >= 0.25.0"),
        ("dspark-int4-tp1", lambda d: d["serve"].update(env={"VLLM_USE_V2_MODEL_RUNNER": "0"}),
         "runs only on Model Runner V2"),
        ("dspark-int4-tp1", lambda d: d["serve"]["speculative"].update(enable_adaptive_verification=True),
         "GDN linear-attention"),
        ("pr620-fp8-tp2", lambda d: d["host"].update(gpu_count=1), "tensor_parallel_size 2 is larger"),
        ("pr620-fp8-tp2", lambda d: d["serve"].update(max_model_len="lots"), "serve.max_model_len:"),
        ("pr620-fp8-tp2", lambda d: d["image"].update(tag="latest"), "not a pin"),
        ("pr620-fp8-tp2", lambda d: d["claims"][0].pop("value"), "needs value"),
        ("cpu-tiny", lambda d: d.pop("tiny"), "tiny section"),
        # A CPU recipe has no GPUs to count: its TP is checked against the cores its ranks are bound to.
        ("cpu-tiny", lambda d: d["host"].update(cpu_cores_min=1), "tensor parallel size 2 is larger than "
         "host.cpu_cores_min 1"),
    ],
)
def test_known_bad_combinations_are_refused(tmp_path, name, edit, message):
    with pytest.raises(BadInput) as error:
        load_recipe_file(_variant(tmp_path, name, edit))
    text = str(error.value)
    assert message in text
    assert "\n" not in text


def test_unknown_recipe_names_the_choices():
    with pytest.raises(BadInput, match="unknown recipe 'nope': choose one of cpu-tiny"):
        load_recipe("nope")


def test_claim_sources_survive_yaml_and_a_source_cut_at_a_comment_is_refused(tmp_path):
    # YAML reads an unquoted " #" as the start of a comment: "PR #620" arrives as "PR".
    cut = yaml.safe_load("source: intel/llm-scaler PR #620 (its description)\n")["source"]
    assert cut == "intel/llm-scaler PR"
    shipped = load_recipe("pr620-fp8-tp2")
    assert all("#620" in claim.source for claim in shipped.claims)
    assert all(claim.url == "https://github.com/intel/llm-scaler/pull/620" for claim in shipped.claims)
    claim = shipped.claims[0].model_dump() | {"source": cut}
    with pytest.raises(ValueError, match="ends mid-reference: quote it in the YAML"):
        Claim.model_validate(claim)


# vllm-project/vllm PR #41834 (https://github.com/vllm-project/vllm/pull/41834), as docs/facts.md reports it:
# "num_speculative_tokens above the drafter's block size collapses acceptance (k=7 on a block-5 drafter: 4.4%,
# k=5: 34.7%)". The shipped DSpark drafter's config.json has block_size 7 (docs/facts.md, Drafter shape).
def test_k_above_the_drafters_block_size_is_refused(tmp_path):
    def edit(data):
        data["drafter"]["block_size"] = 5
        data["serve"]["speculative"]["num_speculative_tokens"] = 7
        data.pop("tune")
    with pytest.raises(BadInput) as error:
        load_recipe_file(_variant(tmp_path, "dspark-int4-tp1", edit))
    text = str(error.value)
    assert "num_speculative_tokens 7 is above the drafter's block_size 5" in text
    assert "set num_speculative_tokens <= 5" in text and "\n" not in text


# vllm-project/vllm #50708 (https://github.com/vllm-project/vllm/issues/50708): "vllm/config/vllm.py:1689,
# _set_max_num_scheduled_tokens, computes max_num_batched_tokens - (max_num_new_slots_for_drafting *
# max_num_seqs)", and for DFlash the slots per request are "exactly num_speculative_tokens"; the start fails with
# "max_num_scheduled_tokens is set to -1792, which does not allow any tokens to be scheduled".
@pytest.mark.parametrize(("batched", "seqs", "k", "left"), [(64, 16, 4, 0), (2048, 256, 15, -1792), (48, 16, 4, -16)])
def test_a_dflash_step_budget_of_no_token_is_refused(tmp_path, batched, seqs, k, left):
    def edit(data):
        data["serve"].update(max_num_batched_tokens=batched, max_num_seqs=seqs)
        data["serve"]["speculative"]["num_speculative_tokens"] = k
        data["drafter"].pop("block_size")
        data.pop("tune")
    with pytest.raises(BadInput) as error:
        load_recipe_file(_variant(tmp_path, "pr620-fp8-tp2", edit))
    text = str(error.value)
    assert f"max_num_batched_tokens {batched} - num_speculative_tokens {k} x max_num_seqs {seqs} = {left}" in text
    assert f"raise max_num_batched_tokens above {k * seqs}" in text and "\n" not in text


def test_one_token_left_in_the_step_is_accepted(tmp_path):
    # 65 - 4 x 16 = 1: one token can still be scheduled, which vLLM allows (#50708 refuses "no tokens").
    def edit(data):
        data["serve"].update(max_num_batched_tokens=65, max_num_seqs=16)
        data.pop("tune")
    assert load_recipe_file(_variant(tmp_path, "pr620-fp8-tp2", edit)).serve.max_num_seqs == 16


def test_tune_never_proposes_a_candidate_without_a_step_budget(tmp_path):
    # dspark-int4-tp1 serves max_num_seqs 16 and tunes k up to 7: 64 batched tokens leave 64 - 7 x 16 < 1.
    def edit(data):
        data["tune"]["max_num_batched_tokens"] = [64, 4096]
    with pytest.raises(BadInput) as error:
        load_recipe_file(_variant(tmp_path, "dspark-int4-tp1", edit))
    assert "tune: the candidate" in str(error.value) and "max_num_batched_tokens 64" in str(error.value)


def test_tune_never_proposes_k_above_the_block(tmp_path):
    def edit(data):
        data["tune"]["num_speculative_tokens"] = {"low": 4, "high": 8}
    with pytest.raises(BadInput) as error:
        load_recipe_file(_variant(tmp_path, "dspark-int4-tp1", edit))
    assert "num_speculative_tokens=8" in str(error.value) and "block_size 7" in str(error.value)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("VLLM_LOGGING_LEVEL", "INFO\nLD_PRELOAD=/tmp/x.so", "line break or control character"),
    ("VLLM_LOGGING_LEVEL", "INFO\r", "line break or control character"),
    ("BAD NAME", "1", "not an environment variable name"),
    ("1ST", "1", "not an environment variable name"),
])
def test_serve_env_that_would_add_env_file_lines_is_refused(tmp_path, name, value, message):
    # Each serve.env entry becomes one NAME=VALUE line of the unit's docker env-file: a line break is a new entry.
    path = _variant(tmp_path, "pr620-fp8-tp2", lambda d: d["serve"].update(env={name: value}))
    with pytest.raises(BadInput) as error:
        load_recipe_file(path)
    text = str(error.value)
    assert "serve.env" in text and message in text and "\n" not in text
    assert "LD_PRELOAD" not in text


def test_serve_env_and_the_env_flag_share_one_rule():
    from b70ctl.serve.cli import _env_pairs

    with pytest.raises(BadInput) as error:
        _env_pairs(["A=1\nB=2"])
    assert str(error.value) == "--env A: the value holds a line break or control character: give one line"


def test_a_duplicate_key_in_a_recipe_file_is_refused_with_its_line(tmp_path):
    text = recipe_path("pr620-fp8-tp2").read_text()
    assert text.count("\nname: ") == 1
    path = tmp_path / "recipe.yaml"
    path.write_text(text.replace("\nname: ", "\nname: shadowed\nname: ", 1))
    line = path.read_text().splitlines().index("name: shadowed") + 1
    with pytest.raises(BadInput) as error:
        load_recipe_file(path)
    message = str(error.value)
    assert f"key 'name' on line {line + 1} is given already on line {line}" in message
    assert "\n" not in message


def test_a_duplicate_nested_key_is_refused(tmp_path):
    text = recipe_path("pr620-fp8-tp2").read_text()
    path = tmp_path / "recipe.yaml"
    path.write_text(text.replace("  max_num_seqs: 1\n", "  max_num_seqs: 1\n  max_num_seqs: 64\n", 1))
    with pytest.raises(BadInput) as error:
        load_recipe_file(path)
    assert "key 'max_num_seqs'" in str(error.value)
