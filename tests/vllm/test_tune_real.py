"""b70ctl tune on real vLLM (CPU): a small space (k in {2, 4}, k=4 the recipe's default), one request per workload,
so the whole tune is at most five server starts (the baseline, two candidates, the final pair) and a few dozen
requests (7 min on this machine kind under load, load average 8 falling to 4).

The candidates and the baseline run at TP=1 here to keep the starts short; the machinery is the command's own:
LocalServing renders each candidate with render_serve, the reference comes from the target-only baseline, and
every rate is the engine's (vLLM's per-request histograms).
"""

from __future__ import annotations

import json

import yaml

from b70ctl.recipes.model import Recipe
from b70ctl.tune.render import write_tune_outputs
from b70ctl.tune.run import run_tune
from b70ctl.tune.serving import LocalServing
from b70ctl.tune.state import STATE_FILE


def small_space(recipe: Recipe) -> Recipe:
    data = recipe.model_dump(mode="python")
    data["serve"]["tensor_parallel_size"] = 1
    data["workloads"] = [
        {**workload, "min_requests": 1, "max_requests": 1}
        for workload in data["workloads"] if workload["name"] in ("short", "acceptance_friendly")
    ]
    data["tune"] = {"num_speculative_tokens": [2, 4], "budget_requests": 8, "first_rung_requests": 1,
                    "final_requests": 1}
    return Recipe.model_validate(data)


def test_tune_on_real_vllm(cpu_tiny, tiny_models, tmp_path):
    recipe = small_space(cpu_tiny)
    servers = LocalServing(recipe, tiny_models, tmp_path / "logs", timeout_s=900)
    report = run_tune(recipe, servers, tmp_path)
    write_tune_outputs(report, tmp_path)

    # Greedy speculation is lossless: every candidate matched the target-only baseline token for token.
    assert all(c.disqualified is None and c.correctness == "5/5 identical" for c in report.candidates), \
        [(c.label, c.correctness, c.disqualified) for c in report.candidates]
    assert {c.label for c in report.candidates} == {"k=2", "k=4"}
    assert all(c.halving.n == 2 and c.halving.score_tok_s > 0 for c in report.candidates)
    assert report.outcome in ("tuned", "default_best") and report.final is not None
    assert report.final.winner.n == 2 and report.spent_requests <= 8
    # Every rate is on the engine's clock.
    lines = (tmp_path / STATE_FILE).read_text().splitlines()[1:]
    assert lines and all(json.loads(line)["client_timed"] == 0 for line in lines)
    tuned = yaml.safe_load((tmp_path / "b70_tuned.yml").read_text())["vllm_serve_tuned"]
    assert tuned["overrides"] == report.tuned_overrides and tuned["budget_requests"] == 8
    assert (tmp_path / "tune-scores.svg").read_text().startswith("<svg")
    print(f"\n{report.summary}\n" + (tmp_path / "tune.md").read_text())
