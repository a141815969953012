"""The tune section of a recipe: what may be tuned is data, validated so that no candidate is a recipe the
validator refuses, and only knobs the recipe's vLLM has."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from b70ctl.errors import BadInput
from b70ctl.recipes import load_recipe, load_recipe_file, recipe_names, recipe_path
from b70host.topology import CCL_PROFILES
from vllm_import import builtin_sys_intern


def _variant(tmp_path: Path, name: str, edit) -> Path:
    data = yaml.safe_load(recipe_path(name).read_text())
    edit(data)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_shipped_spaces():
    tiny = load_recipe("cpu-tiny")
    assert tiny.tune.knobs() == {"method": ["ngram"], "num_speculative_tokens": [1, 2, 3, 4, 5, 6],
                                 "prompt_lookup_min": [2], "prompt_lookup_max": [2, 4]}
    assert len(tiny.tune.grid()) == 6 + 2 * 2  # the draft model's k, then ngram's k x windows
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
    untuned = set()
    for name in recipe_names():
        recipe = load_recipe(name)
        if recipe.tune is None:  # a race's entrant as it is (one candidate)
            untuned.add(name)
            continue
        for profile in ("p2p", "no-p2p"):
            for overrides in recipe.tune.grid(profile):
                tuned = recipe.with_overrides(overrides)
                assert tuned.tune is None
                if "num_speculative_tokens" in overrides:
                    assert tuned.serve.speculative.num_speculative_tokens == overrides["num_speculative_tokens"]
    assert untuned <= {"cpu-tiny-ngram", "cpu-tiny-target-only"}, untuned


def test_k_as_a_list_skips_values(tmp_path):
    def listed(data):
        data["tune"]["num_speculative_tokens"] = [2, 4]
        data["tune"].pop("ngram")

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


def test_ngram_candidates_draft_without_the_model_through_the_one_render():
    """An ngram candidate of cpu-tiny reaches vLLM as method ngram with its k and window and no draft model; a
    draft-model candidate as the recipe's method, without a window (vLLM reads it for ngram only)."""
    from b70ctl.serve.render import ServeContext, render_serve
    from b70ctl.tune.run import candidates_of

    recipe = load_recipe("cpu-tiny")
    candidates, default = candidates_of(recipe, None)
    assert default.overrides == {"method": "draft_model", "num_speculative_tokens": 4, "prompt_lookup_min": None,
                                 "prompt_lookup_max": None}
    assert default in candidates and len(candidates) == 10  # the default is on the grid, not added
    assert {tuple(c.overrides) for c in candidates} == {tuple(default.overrides)}  # every knob named by each
    context = ServeContext(model_dir="/m/target", drafter_dir="/m/draft-perturbed", port=8000)

    def served(overrides):
        argv = render_serve(recipe.with_overrides(overrides), context).argv
        return json.loads(argv[argv.index("--speculative-config") + 1])

    ngram = next(c for c in candidates if c.label == "ngram, k=4, lookup min=2, lookup max=4")
    assert served(ngram.overrides) == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                       "prompt_lookup_max": 4}
    draft = next(c for c in candidates if c.label == "draft_model, k=2")
    assert served(draft.overrides) == {"method": "draft_model", "num_speculative_tokens": 2,
                                       "model": "/m/draft-perturbed"}


def test_every_ngram_candidate_is_a_speculative_config_vllm_itself_accepts():
    """The field names and limits came from vLLM's config/speculative.py: its own SpeculativeConfig (the object
    `vllm serve --speculative-config` builds) takes each ngram candidate's rendered JSON as it is, and refuses the
    window the grid leaves out."""
    with builtin_sys_intern():
        from vllm.config import SpeculativeConfig

    from b70ctl.serve.render import ServeContext, render_serve
    from b70ctl.tune.run import candidates_of

    recipe = load_recipe("cpu-tiny")
    candidates, _ = candidates_of(recipe, None)
    context = ServeContext(model_dir="/m/target", drafter_dir="/m/draft-perturbed", port=8000)
    ngrams = [c for c in candidates if c.overrides["method"] == "ngram"]
    assert len(ngrams) == 4
    for candidate in ngrams:
        argv = render_serve(recipe.with_overrides(candidate.overrides), context).argv
        spec = json.loads(argv[argv.index("--speculative-config") + 1])
        accepted = SpeculativeConfig(**spec)
        assert (accepted.method, accepted.num_speculative_tokens, accepted.prompt_lookup_min,
                accepted.prompt_lookup_max) == (spec["method"], spec["num_speculative_tokens"],
                                                spec["prompt_lookup_min"], spec["prompt_lookup_max"])
    with pytest.raises(ValueError, match="prompt_lookup_min=4 must be <= prompt_lookup_max=2"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=4, prompt_lookup_max=2)


def test_an_ngram_window_wider_at_the_bottom_than_the_top_is_left_out(tmp_path):
    def windows(data):
        data["tune"]["ngram"] = {"num_speculative_tokens": [3], "prompt_lookup_min": [1, 3],
                                 "prompt_lookup_max": [2, 4]}

    grid = load_recipe_file(_variant(tmp_path, "cpu-tiny", windows)).tune.grid()
    assert [(g["prompt_lookup_min"], g["prompt_lookup_max"]) for g in grid if g.get("method") == "ngram"] == [
        (1, 2), (1, 4), (3, 4)]  # 3..2 is a window vLLM refuses


def test_switching_a_sampling_drafter_to_ngram_drops_what_only_a_draft_model_has(tmp_path):
    """dspark-int4 samples its drafts probabilistically; its ngram candidates have nothing to sample."""
    def with_ngram(data):
        data["tune"].update(ngram={"num_speculative_tokens": [4], "prompt_lookup_min": [2],
                                   "prompt_lookup_max": [4]}, max_num_batched_tokens=[], budget_requests=400)

    recipe = load_recipe_file(_variant(tmp_path, "dspark-int4-tp1", with_ngram))
    ngram = [overrides for overrides in recipe.tune.grid() if overrides.get("method") == "ngram"]
    assert ngram == [{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                      "prompt_lookup_max": 4, "draft_sample_method": None}]
    tuned = recipe.with_overrides({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                   "prompt_lookup_max": 4}).serve.speculative
    assert (tuned.method, tuned.draft_sample_method, tuned.prompt_lookup_max) == ("ngram", None, 4)
    with pytest.raises(ValueError, match="keeps the recipe's method"):
        recipe.with_overrides({"method": "eagle3"})


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
        # ngram's knobs: vLLM's own bounds (lookup sizes from 1, min <= max), and k as for any candidate.
        ("cpu-tiny", lambda d: d["tune"]["ngram"].update(prompt_lookup_min=[5]), "every prompt_lookup_min is above"),
        ("cpu-tiny", lambda d: d["tune"]["ngram"].update(prompt_lookup_min=[0]), "start at 1"),
        ("cpu-tiny", lambda d: d["tune"]["ngram"].update(prompt_lookup_max=[4, 4]), "listed twice"),
        ("cpu-tiny", lambda d: d["tune"]["ngram"].update(num_speculative_tokens=[17]),
         "num_speculative_tokens=17, prompt_lookup_min=2, prompt_lookup_max=2 is a recipe this validator refuses"),
        ("cpu-tiny", lambda d: d["tune"]["ngram"].update(draft_sample_method=["greedy"]), "draft_sample_method"),
        ("cpu-tiny", lambda d: d["serve"]["speculative"].update(method="ngram"), "own method is ngram already"),
        ("cpu-tiny", lambda d: d["serve"].update(speculative=None), "need serve.speculative"),
        ("cpu-tiny", lambda d: d["tune"].update(budget_requests=60), "does not cover one round"),
        # A window on a draft-model recipe would be silently ignored by vLLM.
        ("cpu-tiny", lambda d: d["serve"]["speculative"].update(prompt_lookup_max=4), "apply to method 'ngram' only"),
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
