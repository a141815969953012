"""Recipes: the shipped ones validate, bad ones are refused with the field and the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from b70ctl.errors import BadInput
from b70ctl.recipes.model import Claim
from b70ctl.recipes import load_recipe, load_recipe_file, recipe_names, recipe_path


def test_shipped_recipes_load():
    assert recipe_names() == ["cpu-tiny", "dspark-int4-tp1", "pr620-fp8-tp2"]
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
