"""The tune section of a recipe: what may be tuned is data, validated so that no candidate is a recipe the
validator refuses, and only knobs the recipe's vLLM has."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from b70ctl.errors import BadInput
from b70ctl.host.topology import CCL_PROFILES
from b70ctl.recipes import load_recipe, load_recipe_file, recipe_names, recipe_path


def _variant(tmp_path: Path, name: str, edit) -> Path:
    data = yaml.safe_load(recipe_path(name).read_text())
    edit(data)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_shipped_spaces():
    tiny = load_recipe("cpu-tiny")
    assert tiny.tune.knobs() == {"num_speculative_tokens": [1, 2, 3, 4, 5, 6]}
    native = load_recipe("dspark-int4-tp1")
    knobs = native.tune.knobs()
    assert knobs["num_speculative_tokens"] == [4, 5, 6, 7]  # k=7 measured best, 4 and 6 worse
    assert knobs["draft_sample_method"] == ["greedy", "probabilistic"]
    assert len(native.tune.grid()) == 4 * 2 * 3
    pr620 = load_recipe("pr620-fp8-tp2")
    assert 4 in pr620.tune.knobs()["num_speculative_tokens"]  # PR #620's k
    assert "draft_sample_method" not in pr620.tune.knobs()
    # The oneCCL variables apply to the active profile only.
    assert "CCL_SYCL_ALLGATHERV_SMALL_THRESHOLD" in pr620.tune.knobs("p2p")
    assert not any(name.startswith("CCL_") for name in pr620.tune.knobs("no-p2p"))


def test_tuned_oneccl_variables_are_the_profiles_own():
    """A threshold the profile does not set would be a variable nobody has measured with this profile."""
    for name in recipe_names():
        tune = load_recipe(name).tune
        for profile, variables in (tune.oneccl_thresholds if tune else {}).items():
            assert set(variables) <= set(CCL_PROFILES[profile]["env"]), (name, profile)


def test_every_candidate_is_a_valid_recipe():
    for name in recipe_names():
        recipe = load_recipe(name)
        for profile in ("p2p", "no-p2p"):
            for overrides in recipe.tune.grid(profile):
                tuned = recipe.with_overrides(overrides)
                assert tuned.tune is None
                if "num_speculative_tokens" in overrides:
                    assert tuned.serve.speculative.num_speculative_tokens == overrides["num_speculative_tokens"]


def test_k_as_a_list_skips_values(tmp_path):
    def listed(data):
        data["tune"]["num_speculative_tokens"] = [2, 4]

    assert load_recipe_file(_variant(tmp_path, "cpu-tiny", listed)).tune.grid() == [
        {"num_speculative_tokens": 2}, {"num_speculative_tokens": 4}]


def test_with_overrides_changes_only_the_knobs():
    recipe = load_recipe("dspark-int4-tp1")
    tuned = recipe.with_overrides({"num_speculative_tokens": 5, "draft_sample_method": "greedy",
                                   "max_num_batched_tokens": 2048})
    assert (tuned.serve.speculative.num_speculative_tokens, tuned.serve.speculative.draft_sample_method,
            tuned.serve.max_num_batched_tokens) == (5, "greedy", 2048)
    assert tuned.serve.speculative.method == "dspark" and tuned.workloads == recipe.workloads
    assert recipe.serve.speculative.num_speculative_tokens == 7  # the recipe itself is untouched
    with pytest.raises(ValueError, match="not a knob"):
        recipe.with_overrides({"enable_adaptive_verification": True})


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        # Known-bad settings are not knobs at all: the section refuses the key.
        ("dspark-int4-tp1", lambda d: d["tune"].update(enable_adaptive_verification=[True, False]),
         "tune.enable_adaptive_verification"),
        # A value outside what the recipe model accepts makes a candidate the validator refuses.
        ("cpu-tiny", lambda d: d["tune"].update(num_speculative_tokens={"low": 15, "high": 17}),
         "num_speculative_tokens=17 is a recipe this validator refuses"),
        ("cpu-tiny", lambda d: d["tune"].update(max_num_batched_tokens=[8]),
         "max_num_batched_tokens=8 is a recipe this validator refuses"),
        # vLLM 0.21 has greedy | gumbel, and only under Model Runner V2 (the recipe runs V1).
        ("pr620-fp8-tp2", lambda d: d["tune"].update(draft_sample_method=["greedy", "probabilistic"]),
         "no 'probabilistic' draft sampling"),
        ("pr620-fp8-tp2", lambda d: d["tune"]["oneccl_thresholds"].update(
            {"no-p2p": {"CCL_SYCL_ALLREDUCE_SIMPLE_THRESHOLD": [65536]}}), "no-p2p profile's thresholds"),
        ("pr620-fp8-tp2", lambda d: d["tune"]["oneccl_thresholds"]["p2p"].update(CCL_TOPO_P2P_ACCESS=[0, 1]),
         "not a oneCCL threshold"),
        ("cpu-tiny", lambda d: d["tune"].update(oneccl_thresholds={"p2p": {"CCL_X_THRESHOLD": [1]}}),
         "XPU hosts only"),
        ("dspark-int4-tp1", lambda d: d["tune"].update(oneccl_thresholds={"p2p": {"CCL_X_THRESHOLD": [1]}}),
         "no collectives"),
        ("cpu-tiny", lambda d: d["tune"].update(num_speculative_tokens={"low": 6, "high": 1}), "high is below low"),
        ("cpu-tiny", lambda d: d["tune"].update(num_speculative_tokens=[]), "give at least one value"),
        ("cpu-tiny", lambda d: d["tune"].update(num_speculative_tokens=[2, 2]), "listed twice"),
        ("cpu-tiny", lambda d: d["tune"].update(budget_requests=20), "does not cover one round"),
        ("dspark-int4-tp1", lambda d: d["tune"].update(max_num_batched_tokens=list(range(1024, 1024 * 10, 1024))),
         "more than 64"),
        ("cpu-tiny", lambda d: d["serve"]["speculative"].update(method="ngram") or d.update(tune={
            "draft_sample_method": ["greedy"], "budget_requests": 100}), "nothing to sample"),
    ],
)
def test_bad_spaces_are_refused(tmp_path, name, edit, message):
    with pytest.raises(BadInput, match=message):
        load_recipe_file(_variant(tmp_path, name, edit))


def test_the_search_space_is_not_part_of_the_appliance_hash():
    """A tune section says what may be tried, not what is served: adding or changing it restarts nothing."""
    from b70ctl.lock.model import appliance_hash, load_recipe_and_lock

    recipe, lock, _ = load_recipe_and_lock("cpu-tiny")
    without = recipe.model_copy(update={"tune": None})
    assert appliance_hash(recipe, lock) == appliance_hash(without, lock)
    served_differently = recipe.with_overrides({"num_speculative_tokens": 2})
    assert appliance_hash(served_differently, lock) != appliance_hash(recipe, lock)
