"""b70ctl tune's race on real vLLM (CPU): the embedded default's entrants, cpu-tiny (its own knob k in {2, 4}, k=4
its default), cpu-tiny-ngram and cpu-tiny-target-only, in one halving with one request per workload and a budget
of one round and the final: at most seven server starts (one baseline, four candidates, the final pair).

The candidates and the baseline run at TP=1 here to keep the starts short; the machinery is the command's own:
LocalServing renders each candidate with render_serve, the one reference comes from the target-only baseline the
three recipes share, each candidate passes the gate against silent garbage at its first serve and answers the same
at a later one, and every rate is the engine's (vLLM's per-request histograms). Which recipe wins is this
machine's measurement and is not asserted: that every candidate was served, checked and measured, and that the
winner is what the files say, is.
"""

from __future__ import annotations

import json

import yaml

from b70ctl.recipes import load_recipe
from b70ctl.recipes.model import Recipe
from b70ctl.tune.render import write_tune_outputs
from b70ctl.tune.run import Entrant, run_race
from b70ctl.tune.serving import LocalServing
from b70ctl.tune.state import STATE_FILE

BUDGET = 12  # round 0: 4 candidates x 1 request x 2 workloads = 8; the final: 2 x 1 x 2 = 4


def small(recipe: Recipe) -> Recipe:
    data = recipe.model_dump(mode="python")
    data["serve"]["tensor_parallel_size"] = 1
    data["workloads"] = [
        {**workload, "min_requests": 1, "max_requests": 1}
        for workload in data["workloads"] if workload["name"] in ("short", "acceptance_friendly")
    ]
    if data.get("tune"):
        data["tune"] = {"num_speculative_tokens": [2, 4], "budget_requests": BUDGET, "first_rung_requests": 1,
                        "final_requests": 1}
    return Recipe.model_validate(data)


def test_race_on_real_vllm(cpu_tiny, tiny_models, tmp_path):
    recipes = [small(cpu_tiny), small(load_recipe("cpu-tiny-ngram")), small(load_recipe("cpu-tiny-target-only"))]
    entrants = [Entrant(recipe, LocalServing(recipe, tiny_models, tmp_path / "logs", timeout_s=900))
                for recipe in recipes]
    report = run_race(entrants, tmp_path, roofline_inputs=entrants[0].servers.roofline_inputs())
    write_tune_outputs(report, tmp_path)

    # Greedy speculation is lossless, and TP changes nothing at TP=1: every candidate of every recipe matched the
    # target-only baseline token for token.
    assert all(c.disqualified is None and c.correctness == "5/5 identical" for c in report.candidates), \
        [(c.label, c.correctness, c.disqualified) for c in report.candidates]
    assert {c.label for c in report.candidates} == {"cpu-tiny: k=2", "cpu-tiny: k=4",
                                                    "cpu-tiny-ngram: the recipe as it is",
                                                    "cpu-tiny-target-only: the recipe as it is"}
    assert all(c.halving.n == 2 and c.halving.score_tok_s > 0 for c in report.candidates)
    # Each under its roofline, from this machine's copy bandwidth and the tiny target's files.
    assert report.roofline.not_measured is None, report.roofline
    assert all(c.bound_tok_s > c.halving.median_tok_s for c in report.candidates), \
        [(c.label, c.bound_tok_s, c.halving.median_tok_s) for c in report.candidates]
    # The gate against silent garbage at each first serve: repeated prompts, the long prefix from the cache and runs
    # of one token gave the cold answers on real vLLM; the final's second serves answered as the first did.
    assert all(c.gate is not None and c.gate.startswith("gate passed") for c in report.candidates), \
        [(c.label, c.gate) for c in report.candidates]
    # One baseline for the three: they share the target, image and correctness set.
    assert sorted(path.name for path in tmp_path.glob("reference*.json")) == ["reference-cpu-tiny.json"]
    assert sum(entrant.servers.started for entrant in entrants) <= 1 + 4 + 2
    assert report.race == ["cpu-tiny", "cpu-tiny-ngram", "cpu-tiny-target-only"]
    assert report.outcome in ("tuned", "default_best") and report.final is not None
    assert report.spent_requests <= BUDGET
    winner = next(c for c in report.candidates if c.key == report.final.winner_key)
    assert report.winner_recipe == (winner.recipe if report.outcome == "tuned" else "cpu-tiny")
    # Every rate is on the engine's clock.
    lines = (tmp_path / STATE_FILE).read_text().splitlines()[1:]
    assert lines and all(json.loads(line)["client_timed"] == 0 for line in lines)
    written = yaml.safe_load((tmp_path / "b70_tuned.yml").read_text())
    assert written["b70_recipe"] == report.winner_recipe == written["vllm_serve_tuned"]["recipe"]
    print(f"\n{report.summary}\n" + (tmp_path / "tune.md").read_text())
