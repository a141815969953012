"""b70ctl tune: the score, successive halving under a budget, disqualification, resume, and the whole tune against
scripted servers standing in for vLLM (through the same server-owning interface the local vLLM servers use).

The scripted servers' /metrics report the scripts' own engine timing, so each candidate's decode rate is exactly
what its script says: the expected winners below follow from those rates, not from b70ctl's code.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from b70ctl.checks.client import Endpoint
from b70ctl.errors import BadInput
from b70ctl.recipes import load_recipe
from b70ctl.tune.model import Candidate, Measurement, TuneReport
from b70ctl.tune.render import write_tune_outputs
from b70ctl.tune.run import candidates_of, run_tune
from b70ctl.tune.score import robust_score
from b70ctl.tune.search import plan_rounds, successive_halving
from b70ctl.tune.serving import CandidateFailed
from b70ctl.tune.state import STATE_FILE, TuneState
from scripted_server import ScriptedServer, steady_script
from tune_scripts import CPU_TINY, RECIPE, SERVED_RATES

WORKLOADS = 4


# -- the score ---------------------------------------------------------------------------------------------------
def test_score_is_median_minus_scaled_mad():
    assert robust_score([100.0]) == 100.0
    # median 120, deviations 60 30 0 30 60 -> MAD 30, sigma = MAD / 0.6745 (x 1.4826), as the fleet's z-scores scale
    assert robust_score([60.0, 90.0, 120.0, 150.0, 180.0]) == pytest.approx(120 - 30 / 0.6745)
    assert robust_score([]) is None


def test_fast_once_and_slow_often_loses_to_steady():
    steady = [100.0, 101.0, 99.0, 100.0, 100.0]
    erratic = [60.0, 90.0, 120.0, 150.0, 180.0]  # the higher median, the wider spread
    assert sorted(erratic)[2] > sorted(steady)[2]
    assert robust_score(steady) > robust_score(erratic)


# -- the plan ----------------------------------------------------------------------------------------------------
def test_plan_halves_candidates_and_doubles_requests_within_the_budget():
    rounds = plan_rounds(6, WORKLOADS, first_round_requests=1, final_requests=3, budget_requests=120)
    assert [(r.slots, r.requests_per_workload) for r in rounds] == [(6, 1), (3, 2), (2, 4)]
    # 24 + 24 + 32 in the rounds, 2 x 3 x 4 = 24 in the final: 104 <= 120
    assert sum(r.cost(WORKLOADS) for r in rounds) + 24 == 104
    # A smaller budget stops the halving early rather than overrun: 24 + 24 + 24 = 72 <= 90, 72 + 32 > 90.
    short = plan_rounds(6, WORKLOADS, first_round_requests=1, final_requests=3, budget_requests=90)
    assert [(r.slots, r.requests_per_workload) for r in short] == [(6, 1), (3, 2)]
    with pytest.raises(BadInput, match="does not cover one round of 6 candidates"):
        plan_rounds(6, WORKLOADS, first_round_requests=1, final_requests=3, budget_requests=40)


# -- the search, with a measure function of known rates -----------------------------------------------------------
def k_of(candidate: Candidate) -> int:
    return int(candidate.overrides["num_speculative_tokens"])


class FakeMeasure:
    """Rates per k; `wrong` ks fail greedy correctness; raises KeyboardInterrupt at call `interrupt_at`."""

    def __init__(self, rates: dict[int, list[float]], wrong: frozenset[int] = frozenset(),
                 interrupt_at: int | None = None):
        self.rates, self.wrong, self.interrupt_at = rates, wrong, interrupt_at
        self.calls: list[tuple[int, str, int]] = []

    def __call__(self, candidate: Candidate, stage: str, requests: int) -> Measurement:
        if self.interrupt_at is not None and len(self.calls) == self.interrupt_at:
            raise KeyboardInterrupt
        k = k_of(candidate)
        self.calls.append((k, stage, requests))
        now = datetime.now(UTC)
        if k in self.wrong:
            return Measurement(candidate=candidate.key, stage=stage, correctness="3/5 identical",
                               disqualified="greedy outputs differ", measured_at=now)
        count = requests * WORKLOADS
        rates = (self.rates[k] * count)[:count]
        return Measurement(candidate=candidate.key, stage=stage, requests=count, decode_tok_s=rates,
                           correctness="5/5 identical", measured_at=now)


RATES = {1: [50.0], 2: [120.0], 3: [110.0], 4: [100.0], 5: [90.0], 6: [80.0]}


def search(tmp_path, measure, budget=120):
    candidates, _ = candidates_of(RECIPE, None)
    plan = plan_rounds(len(candidates), WORKLOADS, 1, 3, budget)
    state = TuneState(tmp_path / STATE_FILE, {"space": "test", "budget": budget})
    return successive_halving(candidates, plan, measure, state), state


def test_halving_measures_all_then_the_best_half_with_twice_the_requests(tmp_path):
    measure = FakeMeasure(RATES)
    result, state = search(tmp_path, measure)
    assert measure.calls == [(1, "round-0", 1), (2, "round-0", 1), (3, "round-0", 1), (4, "round-0", 1),
                             (5, "round-0", 1), (6, "round-0", 1),
                             (2, "round-1", 2), (3, "round-1", 2), (4, "round-1", 2),
                             (2, "round-2", 4), (3, "round-2", 4)]
    assert k_of(result.winner) == 2
    assert [len(r.kept) for r in result.rounds] == [3, 2, 1]
    assert state.spent_requests == 24 + 24 + 32 <= 120 - 24


def test_budget_is_respected_when_it_stops_the_halving(tmp_path):
    measure = FakeMeasure(RATES)
    result, state = search(tmp_path, measure, budget=90)
    assert [stage for _, stage, _ in measure.calls].count("round-2") == 0
    assert k_of(result.winner) == 2  # the best of the last round measured
    assert state.spent_requests + 2 * 3 * WORKLOADS <= 90


def test_a_candidate_failing_correctness_is_out_whatever_its_speed(tmp_path):
    measure = FakeMeasure({**RATES, 5: [1000.0]}, wrong=frozenset({5}))
    result, _state = search(tmp_path, measure)
    assert [call for call in measure.calls if call[0] == 5] == [(5, "round-0", 1)]
    assert all(json.loads(key)["num_speculative_tokens"] != 5 for r in result.rounds for key in r.kept)
    assert k_of(result.winner) == 2


def test_an_interrupted_search_resumes_measuring_only_what_is_left(tmp_path):
    uninterrupted = FakeMeasure(RATES)
    expected, _ = search(tmp_path / "whole", uninterrupted)
    first = FakeMeasure(RATES, interrupt_at=7)  # killed while serving the second candidate of round 1
    with pytest.raises(KeyboardInterrupt):
        search(tmp_path / "cut", first)
    second = FakeMeasure(RATES)
    resumed, _state = search(tmp_path / "cut", second)
    assert first.calls + second.calls == uninterrupted.calls  # nothing measured twice, nothing skipped
    assert second.calls[0] == (3, "round-1", 2)
    assert resumed.winner == expected.winner and resumed.rounds == expected.rounds


def test_a_state_file_of_another_space_is_refused_and_a_cut_last_line_is_dropped(tmp_path):
    state = TuneState(tmp_path / STATE_FILE, {"space": "a"})
    state.add(Measurement(candidate="x", stage="round-0", requests=4, decode_tok_s=[1.0] * 4,
                          measured_at=datetime.now(UTC)))
    with (tmp_path / STATE_FILE).open("a") as out:
        out.write('{"kind": "measurement", "candid')  # killed mid-write
    reread = TuneState(tmp_path / STATE_FILE, {"space": "a"})
    assert list(reread.measurements) == [("x", "round-0")] and reread.spent_requests == 4
    reread.add(Measurement(candidate="y", stage="round-0", measured_at=datetime.now(UTC)))
    assert len(TuneState(tmp_path / STATE_FILE, {"space": "a"}).measurements) == 2
    with pytest.raises(BadInput, match="holds a tune of another space"):
        TuneState(tmp_path / STATE_FILE, {"space": "b"})


# -- the whole tune against scripted servers ---------------------------------------------------------------------
def rate_key(candidate: Candidate) -> int | str:
    """A draft-model candidate by its k, an ngram candidate by its label."""
    return candidate.label if candidate.overrides.get("method") == "ngram" else k_of(candidate)


class ScriptedServing:
    """The server-owning interface over scripted servers: candidate k serves at rates[k] tok/s (an ngram candidate
    at rates[its label], else 100 tok/s); `wrong` ks answer other greedy tokens than the baseline; `interrupt_at`
    stops the tune at that candidate start."""

    def __init__(self, rates: dict[int | str, float | list[float]], wrong: frozenset[int | str] = frozenset(),
                 no_start: frozenset[int] = frozenset(), interrupt_at: int | None = None):
        self.rates, self.wrong, self.no_start, self.interrupt_at = rates, wrong, no_start, interrupt_at
        self.model = RECIPE.serve.served_model_name
        self.baseline_starts = 0
        self.starts: list[int] = []

    def roofline_inputs(self):
        """As LocalServing's: here nothing was measured, and each input says why."""
        from b70ctl.report.model import RooflineInputs

        return RooflineInputs(memory_bandwidth_unavailable="scripted servers", target_shape_unavailable="scripted")

    @contextmanager
    def baseline(self):
        self.baseline_starts += 1
        with ScriptedServer(model=self.model) as server:
            server.speculates = False
            server.default_script = steady_script(300.0)
            yield Endpoint(server.url, model=self.model, timeout_s=10)

    @contextmanager
    def candidate(self, candidate: Candidate):
        if self.interrupt_at is not None and len(self.starts) == self.interrupt_at:
            raise KeyboardInterrupt
        k = rate_key(candidate)
        self.starts.append(k)
        if k in self.no_start:
            raise CandidateFailed(f"vLLM server candidate-k={k} exited with code 1 during start")
        with ScriptedServer(model=self.model) as server:
            rate = self.rates.get(k, 100.0)  # a list: the rate of each start of this candidate in turn
            server.default_script = steady_script(rate if isinstance(rate, float) else
                                                  rate[min(self.starts.count(k), len(rate)) - 1])
            if k in self.wrong:
                server.first_token_id = 999
            yield Endpoint(server.url, model=self.model, timeout_s=10)


def test_tune_against_scripted_servers_picks_the_fastest_correct_candidate(tmp_path):
    servers = ScriptedServing(SERVED_RATES, wrong=frozenset({5}), no_start=frozenset({1}))
    report = run_tune(RECIPE, servers, tmp_path)
    write_tune_outputs(report, tmp_path)
    assert servers.baseline_starts == 1
    # round 0: all six; round 1: k=2, 3, 4; round 2: k=2, 3; final: the default k=4, then the winner k=2
    assert servers.starts == [1, 2, 3, 4, 5, 6, 2, 3, 4, 2, 3, 4, 2]
    results = {k_of(Candidate(overrides=c.overrides)): c for c in report.candidates}
    assert "greedy outputs differ" in results[5].disqualified and results[5].correctness == "0/5 identical"
    assert "did not start" in results[1].disqualified
    assert results[2].halving.score_tok_s == pytest.approx(240.0)
    assert results[4].is_default and results[4].rounds == 2
    assert report.outcome == "tuned" and report.tuned_overrides == {"num_speculative_tokens": 2}
    assert report.final.default.score_tok_s == pytest.approx(200.0)
    assert report.final.winner.n == report.final.default.n == 3 * WORKLOADS
    assert report.spent_requests <= report.budget_requests
    # the files: one model, the markdown, the plot, and what the appliance will place in host_vars
    assert TuneReport.model_validate_json((tmp_path / "tune.json").read_text()) == report
    markdown = (tmp_path / "tune.md").read_text()
    assert "k=2 beats the recipe's default (k=4)" in markdown and "disqualified: greedy outputs differ" in markdown
    svg = (tmp_path / "tune-scores.svg").read_text()
    assert svg.startswith("<svg") and "k=4: score 200.0 tok/s" in svg and "#d62728" in svg
    tuned = yaml.safe_load((tmp_path / "b70_tuned.yml").read_text())["vllm_serve_tuned"]
    assert tuned["overrides"] == {"num_speculative_tokens": 2} and tuned["score_tok_s"] == pytest.approx(240.0)
    assert tuned["budget_requests"] == 120 and tuned["date"] == report.finished_at.date().isoformat()


def test_when_the_default_wins_the_report_says_it_was_already_best(tmp_path):
    servers = ScriptedServing({**SERVED_RATES, 4: 300.0, 5: 100.0})
    report = run_tune(RECIPE, servers, tmp_path)
    write_tune_outputs(report, tmp_path)
    assert report.outcome == "default_best" and report.tuned_overrides == {}
    assert servers.starts[-1] == 4 and servers.starts.count(4) == 4  # three rounds, then the final alone
    assert "the recipe's default was already best" in (tmp_path / "tune.md").read_text()
    assert yaml.safe_load((tmp_path / "b70_tuned.yml").read_text())["vllm_serve_tuned"]["overrides"] == {}


def test_a_halving_winner_that_loses_the_final_leaves_the_default(tmp_path):
    """k=2 leads every round, then measures below the default when both are served back to back."""
    servers = ScriptedServing({**SERVED_RATES, 5: 100.0, 2: [240.0, 240.0, 240.0, 150.0]})
    report = run_tune(RECIPE, servers, tmp_path)
    assert servers.starts[-2:] == [4, 2]
    assert report.rounds[-1].kept == [Candidate(overrides={"num_speculative_tokens": 2}).key]
    assert report.final.winner.score_tok_s == pytest.approx(150.0)
    assert report.final.default.score_tok_s == pytest.approx(200.0)
    assert report.outcome == "default_best" and report.tuned_overrides == {}
    assert report.summary.startswith("the recipe's default was already best: the halving's winner (k=2)")


def test_an_interrupted_tune_resumes_with_its_reference_and_measures_only_what_is_left(tmp_path):
    first = ScriptedServing(SERVED_RATES, interrupt_at=8)  # stopped at round 1's third candidate
    with pytest.raises(KeyboardInterrupt):
        run_tune(RECIPE, first, tmp_path)
    second = ScriptedServing(SERVED_RATES)
    report = run_tune(RECIPE, second, tmp_path)
    assert second.baseline_starts == 0  # the reference recorded by the first run is reused
    whole = ScriptedServing(SERVED_RATES)
    expected = run_tune(RECIPE, whole, tmp_path / "whole")
    assert first.starts + second.starts == whole.starts
    assert report.tuned_overrides == expected.tuned_overrides == {"num_speculative_tokens": 5}
    assert report.spent_requests == expected.spent_requests


NGRAM_FAST = "ngram, k=4, lookup min=2, lookup max=4"
NGRAM_WRONG = "ngram, k=2, lookup min=2, lookup max=2"


def test_ngram_candidates_are_served_gated_and_scored_like_the_draft_models(tmp_path):
    """cpu-tiny's whole space: an ngram candidate that answers other greedy tokens is out whatever its speed (the
    same gate), the fastest ngram candidate wins the halving and the final, and what is applied names ngram with
    its window."""
    servers = ScriptedServing({**SERVED_RATES, 5: 100.0, NGRAM_FAST: 320.0, NGRAM_WRONG: 900.0},
                              wrong=frozenset({NGRAM_WRONG}))
    report = run_tune(CPU_TINY, servers, tmp_path)
    write_tune_outputs(report, tmp_path)
    # round 0: ten candidates; round 1: the best five by score; round 2: three; the final: default, then winner
    assert servers.starts[:10] == [1, 2, 3, 4, 5, 6, NGRAM_WRONG, "ngram, k=2, lookup min=2, lookup max=4",
                                   "ngram, k=4, lookup min=2, lookup max=2", NGRAM_FAST]
    assert servers.starts[10:15] == [NGRAM_FAST, 2, 3, 4, 6]
    assert servers.starts[15:] == [NGRAM_FAST, 2, 3, 4, NGRAM_FAST]
    results = {c.label: c for c in report.candidates}
    assert "greedy outputs differ" in results[NGRAM_WRONG].disqualified and results[NGRAM_WRONG].rounds == 1
    assert results[NGRAM_FAST].halving.score_tok_s == pytest.approx(320.0)
    assert results["draft_model, k=4"].is_default
    assert report.outcome == "tuned" and report.tuned_overrides == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert report.final.winner.score_tok_s == pytest.approx(320.0)
    assert report.final.default.score_tok_s == pytest.approx(200.0)
    assert report.spent_requests <= report.budget_requests == 160
    # The knobs as served: both methods, the union of k, and the window of the ngram candidates only.
    assert report.knobs == {"method": ["draft_model", "ngram"], "num_speculative_tokens": [1, 2, 3, 4, 5, 6],
                            "prompt_lookup_min": [2], "prompt_lookup_max": [2, 4]}
    (tuned,) = yaml.safe_load((tmp_path / "b70_tuned.yml").read_text()).values()
    assert CPU_TINY.with_overrides(tuned["overrides"]).serve.speculative.method == "ngram"
    svg = (tmp_path / "tune-scores.svg").read_text()
    assert ">lookup max<" in svg and ">ngram<" in svg and ">draft_model<" in svg
    assert f"{NGRAM_FAST}: score 320.0 tok/s" in svg and f"{NGRAM_WRONG}: disqualified" in svg
    # A draft-model candidate has no window: its dots are in the method and k panels, not the two lookup panels.
    assert svg.count("draft_model, k=2: score") == 2 and svg.count(f"{NGRAM_FAST}: score") == 4
    assert "ngram, k=4, lookup min=2, lookup max=4 beats the recipe's default (draft_model, k=4)" in (
        tmp_path / "tune.md").read_text()


def test_the_command_refuses_in_one_line(tmp_path):
    import subprocess
    import sys

    def b70ctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", "from b70ctl.cli import main; main()", "tune", *args],
                              capture_output=True, text=True, timeout=120)

    for args, message in [
        (("--recipe", "pr620-fp8-tp2"), "error: recipe pr620-fp8-tp2 runs on B70 hosts"),
        (("--budget-requests", "0"), "error: --budget-requests 0:"),
        (("--recipe", "cpu-tiny", "--recipe", "cpu-tiny"), "error: --recipe cpu-tiny is given twice"),
        (("--recipe", "cpu-tiny", "--recipe", "mtp3-int4-tp2"), "error: recipe mtp3-int4-tp2 runs on B70 hosts"),
        (("--budget-requests", "30", "--out", str(tmp_path)), "error: a budget of 30 requests does not cover one "
                                                              "round of 10 candidates"),
    ]:
        done = b70ctl(*args)
        assert done.returncode == 2 and done.stdout == ""
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(message), done.stderr


def test_the_plot_has_a_panel_per_knob_with_the_default_marked():
    """dspark-int4's space: k, draft sampling and batched tokens (whose default, vLLM's own, is not on the grid)."""
    from b70ctl.tune.model import CandidateResult, Figures
    from b70ctl.tune.render import scores_svg

    recipe = load_recipe("dspark-int4-tp1")
    candidates, default = candidates_of(recipe, None)
    assert len(candidates) == 4 * 2 * 3 + 1 and default.overrides == {
        "num_speculative_tokens": 7, "draft_sample_method": "probabilistic", "max_num_batched_tokens": None}
    results = [CandidateResult(key=c.key, label=c.label, overrides=c.overrides, is_default=c == default, rounds=1,
                               halving=Figures(n=2, median_tok_s=40.0 + index, mad_tok_s=0.0,
                                               score_tok_s=40.0 + index),
                               disqualified="greedy outputs differ" if index == 3 else None)
               for index, c in enumerate(candidates)]
    now = datetime.now(UTC)
    report = TuneReport(recipe=recipe.name, vllm_version=recipe.vllm_version, knobs=recipe.tune.knobs(),
                        default_overrides=default.overrides, workloads=["short"], budget_requests=300,
                        spent_requests=50, started_at=now, finished_at=now, rounds=[], candidates=results,
                        outcome="default_best", tuned_overrides={}, summary="test")
    svg = scores_svg(report)
    for label in (">k<", ">draft sampling<", ">batched tokens<", ">default<", ">probabilistic<"):
        assert label in svg
    default_label = default.label
    assert f"{default_label}: score 64.0 tok/s" in svg and svg.count('stroke="#d62728"') >= 3  # one ring per panel
    assert "greedy outputs differ" in svg


def test_a_p2p_candidate_reaches_vllm_with_its_k_batched_tokens_and_threshold(tmp_path):
    """On a B70 host the candidate goes through render_container: its recipe knobs into argv, its oneCCL
    threshold over the P2P profile's own value, the rest of the profile untouched."""
    from b70ctl.host_documents import load_topology
    from b70ctl.serve.render import ServeContext
    from b70ctl.tune.serving import candidate_command
    from b70host.topology import CCL_PROFILES, TOPOLOGY_PATH, topology
    from sysfs_trees import build_tree

    recipe = load_recipe("pr620-fp8-tp2")
    root = build_tree(tmp_path, "b70x2-switch")
    # p2p only once a probe opened peer memory (b70host/topology.py); here the host's override after ze_peer passed.
    topology(root, 2, profile="p2p", probe="never", write=True)
    host = load_topology(Path(root) / TOPOLOGY_PATH.lstrip("/"))
    assert host.profile == "p2p"
    candidates, default = candidates_of(recipe, host.profile)
    assert default.overrides == {"num_speculative_tokens": 4, "max_num_batched_tokens": 4096,
                                 "CCL_SYCL_ALLGATHERV_SMALL_THRESHOLD": 131072}
    candidate = Candidate(overrides={"num_speculative_tokens": 6, "max_num_batched_tokens": 8192,
                                     "CCL_SYCL_ALLGATHERV_SMALL_THRESHOLD": 262144})
    assert candidate in candidates
    context = ServeContext(model_dir="/models/target", drafter_dir="/models/drafter", host="0.0.0.0", port=8000)
    command = candidate_command(recipe, candidate, context, host)
    argv = command.argv
    assert json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"] == 6
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "8192"
    assert command.env["CCL_SYCL_ALLGATHERV_SMALL_THRESHOLD"] == "262144"
    for name, value in CCL_PROFILES["p2p"]["env"].items():
        if name != "CCL_SYCL_ALLGATHERV_SMALL_THRESHOLD":
            assert command.env[name] == value


def test_the_command_end_to_end_stopped_then_resumed(tmp_path, monkeypatch):
    """`b70ctl tune` with the scripted servers in place of local vLLM: SIGTERM mid-way (as systemd stops it) exits
    143 keeping the measurements; the same command then resumes and prints tune.json with --json."""
    from typer.testing import CliRunner

    import b70ctl.tune.serving
    import b70ctl.verify.embedded
    from b70ctl.cli import app
    from b70ctl.stops import Terminated

    class Stopped(ScriptedServing):
        def candidate(self, candidate: Candidate):
            if len(self.starts) == 3:
                raise Terminated()
            return super().candidate(candidate)

    serving = {"class": Stopped}
    monkeypatch.setattr(b70ctl.verify.embedded, "ensure_models", lambda recipe, models_dir: {"changed": False})
    monkeypatch.setattr(b70ctl.tune.serving, "LocalServing",
                        lambda recipe, models, logs, **options: serving["class"](SERVED_RATES))
    runner = CliRunner()
    stopped = runner.invoke(app, ["tune", "--out", str(tmp_path), "--models-dir", str(tmp_path / "models")])
    assert stopped.exit_code == 143, stopped.output
    assert "the same command resumes from it" in stopped.output
    lines = (tmp_path / STATE_FILE).read_text().splitlines()
    assert len(lines) == 1 + 3  # the space, then the three candidates measured before the stop
    serving["class"] = ScriptedServing
    resumed = runner.invoke(app, ["tune", "--out", str(tmp_path), "--models-dir", str(tmp_path / "models"),
                                  "--json"])
    assert resumed.exit_code == 0, resumed.output
    printed = TuneReport.model_validate_json(resumed.stdout[resumed.stdout.index("{"):])
    assert printed.tuned_overrides == {"method": "draft_model", "num_speculative_tokens": 5}
    assert printed == TuneReport.model_validate_json((tmp_path / "tune.json").read_text())
    # Without --roofline-inputs the local servers' own figures are asked for (these scripted ones have none).
    assert printed.roofline.not_measured == "scripted servers; scripted"


# -- a race of recipes -------------------------------------------------------------------------------------------
RACE_HOST = CPU_TINY.model_copy(update={"tune": CPU_TINY.tune.model_copy(update={
    "num_speculative_tokens": [2, 4], "ngram": None, "budget_requests": 120})})
NGRAM_RECIPE = load_recipe("cpu-tiny-ngram")
TARGET_ONLY = load_recipe("cpu-tiny-target-only")


class RecipeServing(ScriptedServing):
    """One raced recipe's servers: every candidate of it serves at `rate` (or rates[k] for the host's k), the
    target-only baseline at 300 tok/s; `wrong` answers other greedy tokens; `started` is shared by the race."""

    def __init__(self, recipe, started: list[str], rates=None, wrong=False, baselines: list[str] | None = None,
                 alter=None):
        super().__init__(rates or {}, wrong=frozenset({recipe.name}) if wrong else frozenset())
        self.recipe, self.started, self.baselines = recipe, started, baselines if baselines is not None else []
        self.alter = alter  # (serve number from 1, prompt, token ids) -> token ids: a server corrupting answers

    @contextmanager
    def baseline(self):
        self.baselines.append(self.recipe.name)
        with super().baseline() as endpoint:
            yield endpoint

    @contextmanager
    def candidate(self, candidate: Candidate):
        assert candidate.recipe == self.recipe.name
        key = k_of(candidate) if candidate.overrides else self.recipe.name
        self.started.append(f"{self.recipe.name}:{key}")
        with ScriptedServer(model=self.model) as server:
            server.default_script = steady_script(self.rates.get(key, 100.0))
            if self.recipe.name in self.wrong:
                server.first_token_id = 999
            if self.alter is not None:
                serve = self.started.count(self.started[-1])
                server.alter = lambda prompt, ids: self.alter(serve, prompt, ids)
            yield Endpoint(server.url, model=self.model, timeout_s=10)


def test_a_race_keeps_the_fastest_correct_recipe_and_writes_it_as_the_hosts(tmp_path):
    from b70ctl.tune.run import Entrant, run_race

    started: list[str] = []
    baselines: list[str] = []
    entrants = [
        Entrant(RACE_HOST, RecipeServing(RACE_HOST, started, {2: 240.0, 4: 200.0}, baselines=baselines)),
        Entrant(NGRAM_RECIPE, RecipeServing(NGRAM_RECIPE, started, {"cpu-tiny-ngram": 320.0}, baselines=baselines)),
        # fastest of all, and wrong: out whatever its speed
        Entrant(TARGET_ONLY, RecipeServing(TARGET_ONLY, started, {"cpu-tiny-target-only": 900.0}, wrong=True,
                                           baselines=baselines)),
    ]
    report = run_race(entrants, tmp_path)
    write_tune_outputs(report, tmp_path)
    # One baseline: the three recipes' target-only servers are the same server (same target, image, correctness).
    assert baselines == ["cpu-tiny"]
    # Round 0: every recipe's candidates; round 1: the best two (ngram, k=2); the final: the host's default, then
    # the winner, back to back.
    assert started == ["cpu-tiny:2", "cpu-tiny:4", "cpu-tiny-ngram:cpu-tiny-ngram",
                       "cpu-tiny-target-only:cpu-tiny-target-only",
                       "cpu-tiny-ngram:cpu-tiny-ngram", "cpu-tiny:2",
                       "cpu-tiny:4", "cpu-tiny-ngram:cpu-tiny-ngram"]
    results = {c.label: c for c in report.candidates}
    assert "greedy outputs differ" in results["cpu-tiny-target-only: the recipe as it is"].disqualified
    assert results["cpu-tiny: k=4"].is_default
    assert report.race == ["cpu-tiny", "cpu-tiny-ngram", "cpu-tiny-target-only"]
    assert report.outcome == "tuned" and report.winner_recipe == "cpu-tiny-ngram" and report.tuned_overrides == {}
    assert report.final.winner.score_tok_s == pytest.approx(320.0)
    assert report.final.default.score_tok_s == pytest.approx(200.0)
    # Every candidate ran the host recipe's workloads.
    assert report.workloads == ["short", "acceptance_friendly", "natural", "long_prompt"]
    assert report.spent_requests <= 120
    written = yaml.safe_load((tmp_path / "b70_tuned.yml").read_text())
    assert written["b70_recipe"] == "cpu-tiny-ngram"
    assert written["vllm_serve_tuned"]["recipe"] == "cpu-tiny-ngram"
    assert written["vllm_serve_tuned"]["overrides"] == {}
    markdown = (tmp_path / "tune.md").read_text()
    assert "# Race of cpu-tiny, cpu-tiny-ngram, cpu-tiny-target-only" in markdown
    assert "| cpu-tiny-ngram | the recipe as it is | 320.0 |" in markdown
    assert "cpu-tiny-ngram: the recipe as it is beats the recipe's default (cpu-tiny: k=4)" in report.summary


def test_a_race_resumes_from_its_state_and_a_one_recipe_tune_keeps_its_old_keys(tmp_path):
    from b70ctl.tune.run import Entrant, run_race

    def entrants(started):
        return [Entrant(RACE_HOST, RecipeServing(RACE_HOST, started, {2: 240.0, 4: 200.0})),
                Entrant(NGRAM_RECIPE, RecipeServing(NGRAM_RECIPE, started, {"cpu-tiny-ngram": 320.0}))]

    first: list[str] = []
    run_race(entrants(first), tmp_path)
    again: list[str] = []
    report = run_race(entrants(again), tmp_path)
    assert again == [] and report.winner_recipe == "cpu-tiny-ngram"  # everything was measured: nothing served
    # A one-recipe tune names candidates by their overrides alone, as state files written before races did.
    assert Candidate(overrides={"num_speculative_tokens": 2}).key == '{"num_speculative_tokens":2}'
    assert json.loads(Candidate(overrides={}, recipe="cpu-tiny-ngram").key) == {"overrides": {},
                                                                                "recipe": "cpu-tiny-ngram"}


def test_a_race_is_refused_before_anything_starts_when_it_cannot_be_run(tmp_path):
    from b70ctl.tune.run import race_plan

    with pytest.raises(BadInput, match="--recipe cpu-tiny is given twice"):
        race_plan([CPU_TINY, CPU_TINY])
    with pytest.raises(BadInput, match="runs on xpu hosts, cpu-tiny on cpu"):
        race_plan([CPU_TINY, load_recipe("mtp3-int4-tp2")])
    with pytest.raises(BadInput, match=r"none of the raced recipes .* has a tune section"):
        race_plan([NGRAM_RECIPE, TARGET_ONLY])


def test_a_race_over_the_appliance_unit_refuses_a_recipe_whose_image_and_models_were_not_installed():
    """On a host without a raced recipe's own image and models (playbooks/tune.yml installs them), only a recipe
    sharing the host recipe's runs; another is refused before the host is changed (only a look for its race
    directory)."""
    from b70ctl.tune.unit import ApplianceHost, HostCommandFailed, SystemdUnitServing

    class NoShell:
        def run(self, argv, stdin=None):
            raise AssertionError(f"the host was touched: {argv}")

    host = ApplianceHost.model_validate({"name": "b70-a", "unit": "b70-vllm", "port": 8000,
                                         "config_dir": "/etc/b70/vllm", "etc_dir": "/etc/b70"})
    class NoRaceDirectory(NoShell):
        def run(self, argv, stdin=None):
            if argv[:2] == ["ls", "-1"]:  # the only command: is there a race directory (there is none)
                raise HostCommandFailed(argv, "No such file or directory")
            return super().run(argv, stdin)

    unit = SystemdUnitServing(load_recipe("pr620-fp8-tp2"), host, NoRaceDirectory())
    with pytest.raises(BadInput, match=r"--recipe mtp8-fp8-tp2 needs image .*, and b70-a holds no "
                                       "/etc/b70/race/mtp8-fp8-tp2/: race it with playbooks/tune.yml"):
        unit.serving_of(load_recipe("mtp8-fp8-tp2"))
    cpu = SystemdUnitServing(CPU_TINY, host, NoRaceDirectory())
    assert cpu.serving_of(CPU_TINY) is cpu
    assert cpu.serving_of(NGRAM_RECIPE).recipe is NGRAM_RECIPE


def test_a_race_report_shows_each_recipes_published_records_with_their_urls():
    from b70ctl.tune.run import published_records

    records = published_records([load_recipe("mtp3-int4-tp2"), load_recipe("pr620-fp8-tp2")])
    mtp3 = {r.claim: r for r in records if r.recipe == "mtp3-int4-tp2"}
    assert mtp3["code-decode"].tok_s == 109.0
    assert mtp3["code-decode"].url.startswith("https://github.com/bklinkradt/arc-b70-llm-stack/")
    assert any(r.recipe == "pr620-fp8-tp2" and r.tok_s == 72.2 for r in records)


def corrupt_cached_prefix():
    """An answer to a long prompt (past 1024 tokens) whose start this server has seen: token 5 changed, as a
    prefix cache that serves another request's blocks would."""
    seen: set[str] = set()

    def alter(serve: int, prompt, ids: list[int]) -> list[int]:
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        long = len(prompt) > 1024
        start = text[:64]
        if long and start in seen and len(ids) > 5:
            ids = ids[:5] + [ids[5] + 1] + ids[6:]
        seen.add(start)
        return ids
    return alter


def changed_after_restart(serve: int, prompt, ids: list[int]) -> list[int]:
    """From the candidate's second serve on, token 3 of every answer is 999: answers that change with a restart."""
    return ids[:3] + [999] + ids[4:] if serve > 1 and len(ids) > 3 else ids


def test_the_race_disqualifies_a_candidate_the_gate_catches_whatever_its_speed(tmp_path):
    """Greedy identity with the baseline holds for both (their cold answers are right): the first corrupts answers
    whose long prefix it served before, the second answers otherwise after a restart. Each is out, at the first
    position that differs, with both tokens; the honest host recipe wins."""
    from b70ctl.tune.run import Entrant, run_race

    started: list[str] = []
    entrants = [
        Entrant(RACE_HOST, RecipeServing(RACE_HOST, started, {2: 240.0, 4: 200.0})),
        Entrant(NGRAM_RECIPE, RecipeServing(NGRAM_RECIPE, started, {"cpu-tiny-ngram": 900.0},
                                            alter=lambda serve, prompt, ids: corrupting(serve, prompt, ids))),
        Entrant(TARGET_ONLY, RecipeServing(TARGET_ONLY, started, {"cpu-tiny-target-only": 800.0},
                                           alter=changed_after_restart)),
    ]
    corrupting = corrupt_cached_prefix()
    report = run_race(entrants, tmp_path)
    write_tune_outputs(report, tmp_path)
    results = {c.recipe: c for c in report.candidates if c.recipe != "cpu-tiny"}
    cache = results["cpu-tiny-ngram"]
    assert cache.correctness == "5/5 identical" and cache.rounds == 1
    assert cache.disqualified.startswith("the gate against silent garbage:")
    assert "first difference at generated token 5: token 105 before, token 106 now" in cache.disqualified, \
        cache.disqualified
    restarted = results["cpu-tiny-target-only"]
    # It passed its first serve and led round 0; its second serve (round 1) answered otherwise: out.
    assert restarted.gate.startswith("gate passed") and restarted.rounds == 2
    assert "after a restart" in restarted.disqualified and "999" in restarted.disqualified, restarted.disqualified
    assert started.count("cpu-tiny-target-only:cpu-tiny-target-only") == 2
    assert report.winner_recipe == "cpu-tiny" and report.final.winner_key in {
        c.key for c in report.candidates if c.recipe == "cpu-tiny"}
    markdown = (tmp_path / "tune.md").read_text()
    assert "the gate against silent garbage" in markdown


def test_a_race_report_puts_each_candidate_beside_its_roofline(tmp_path):
    """The bound is report/roofline.py's formula over what the serving host measured: its bandwidth over the
    target's weights read per step (the input embedding table left out: one row is read per token), times the
    candidate's tokens per step. A candidate without speculation yields one token per step."""
    from b70ctl.report.model import RooflineInputs
    from b70ctl.tune.run import Entrant, run_race

    inputs = RooflineInputs.model_validate({
        "memory_bandwidth": {"bytes_per_s": 20e9, "method": "a copy", "buffer_bytes": 2**27, "repeats": 5},
        "target_shape": {"directory": "/models/target", "weight_files": 1, "weight_bytes": 2_000_000,
                         "embedding_bytes": 500_000, "num_hidden_layers": 2, "num_key_value_heads": 2,
                         "head_dim": 32, "full_attention_layers": 2}})
    started: list[str] = []
    entrants = [Entrant(RACE_HOST, RecipeServing(RACE_HOST, started, {2: 240.0, 4: 200.0})),
                Entrant(TARGET_ONLY, RecipeServing(TARGET_ONLY, started, {"cpu-tiny-target-only": 150.0}))]
    report = run_race(entrants, tmp_path, roofline_inputs=inputs)
    write_tune_outputs(report, tmp_path)
    per_step = 20e9 / 1_500_000
    plain = next(c for c in report.candidates if c.recipe == "cpu-tiny-target-only")
    assert plain.mean_acceptance_length == 1.0 and plain.bound_tok_s == pytest.approx(per_step)
    drafting = [c for c in report.candidates if c.recipe == "cpu-tiny"]
    assert all(c.mean_acceptance_length and c.mean_acceptance_length > 1 for c in drafting)
    for candidate in drafting:
        assert candidate.bound_tok_s == pytest.approx(per_step * candidate.mean_acceptance_length)
    assert report.roofline.not_measured is None
    assert report.roofline.weight_bytes.value == 1_500_000 and report.roofline.bandwidth_bytes_per_s.value == 20e9
    markdown = (tmp_path / "tune.md").read_text()
    assert f"| 1.00 | {per_step:.1f} | {150.0 / per_step:.0%} |" in markdown
    assert "measured on the serving machine: a copy" in markdown

    # Without the host's inputs: no bound, and the report says what to pass.
    bare = run_race(entrants, tmp_path / "bare")
    assert all(c.bound_tok_s is None for c in bare.candidates)
    assert "b70ctl tune --roofline-inputs" in bare.roofline.not_measured


def test_a_raced_recipe_with_its_own_target_is_bound_by_that_targets_weights(tmp_path):
    """A raced recipe serving another target is bound by the host's bandwidth over its own target's weights (read
    on the host beside its models); without them its bound is not measured, and the report says why."""
    from b70ctl.report.model import RooflineInputs
    from b70ctl.tune.run import race_roofline

    shape = {"directory": "/models/target", "weight_files": 1, "embedding_bytes": 500_000, "num_hidden_layers": 2,
             "num_key_value_heads": 2, "head_dim": 32, "full_attention_layers": 2}
    host = RooflineInputs.model_validate({
        "memory_bandwidth": {"bytes_per_s": 20e9, "method": "a copy", "buffer_bytes": 2**27, "repeats": 5},
        "target_shape": shape | {"weight_bytes": 2_000_000}})
    other = TARGET_ONLY.model_copy(update={"name": "cpu-tiny-bigger", "target": TARGET_ONLY.target.model_copy(
        update={"revision": "f" * 40})})
    own = RooflineInputs.model_validate({"target_shape": shape | {"weight_bytes": 4_500_000},
                                         "memory_bandwidth_unavailable": "not measured beside the raced models"})
    roofline, per_recipe = race_roofline([RACE_HOST, other], host, {"cpu-tiny-bigger": own})
    assert per_recipe["cpu-tiny"][1].value == 1_500_000 and per_recipe["cpu-tiny-bigger"][1].value == 4_000_000
    assert per_recipe["cpu-tiny-bigger"][0].value == 20e9  # the host's bandwidth, whatever the raced inputs say
    assert roofline.weight_bytes.value == 1_500_000 and roofline.not_measured is None
    _, unread = race_roofline([RACE_HOST, other], host)
    assert unread["cpu-tiny-bigger"][1].value is None
    assert "cpu-tiny-bigger's target was not read on the host" in unread["cpu-tiny-bigger"][1].source


# A speculating hybrid target on vLLM >= 0.28.1 (cpu-tiny's 0.32 with GDN layers claimed): the render keeps its
# prefix cache off until the probe passed on the host, and its tune space tries the cache on and off.
HYBRID = CPU_TINY.model_copy(update={
    "target": CPU_TINY.target.model_copy(update={"has_linear_attention": True}),
    "tune": CPU_TINY.tune.model_copy(update={"num_speculative_tokens": [4], "ngram": None,
                                             "prefix_caching": ["off", "on"], "budget_requests": 60})})


class RenderedCacheServing(ScriptedServing):
    """Each candidate's command line as the host's unit would render it (candidate_command); the scripted server
    behind it serves with its prefix cache on exactly when that command line turns it on, at `rates[on]`, and
    then, when `corrupt`, answers a long prompt whose start it has seen with another token (a cache serving
    another request's blocks)."""

    def __init__(self, corrupt: bool, rates: dict[bool, float]):
        super().__init__({})
        self.corrupt, self.cache_rates = corrupt, rates
        self.argvs: dict[str, list[str]] = {}

    @contextmanager
    def candidate(self, candidate: Candidate):
        from b70ctl.serve.render import ServeContext
        from b70ctl.tune.serving import candidate_command

        argv = candidate_command(HYBRID, candidate, ServeContext(model_dir="/models/target",
                                                                 drafter_dir="/models/drafter"), None).argv
        self.argvs[candidate.label] = argv
        cache_on = "--enable-prefix-caching" in argv
        assert cache_on or "--no-enable-prefix-caching" in argv, argv
        with ScriptedServer(model=self.model) as server:
            server.default_script = steady_script(self.cache_rates[cache_on])
            if cache_on and self.corrupt:
                alter = corrupt_cached_prefix()
                server.alter = lambda prompt, ids: alter(1, prompt, ids)
            yield Endpoint(server.url, model=self.model, timeout_s=10)


def test_prefix_caching_on_is_a_candidate_the_gates_probe_judges_on_the_host(tmp_path):
    """The tune serves the cache-on candidate with the cache on (the host's record says nothing yet) and its gate is
    the probe: a cache that corrupts a shared long prefix is caught at the first differing token and the winner
    keeps it off; an honest faster cache wins, and b70_tuned.yml is then the record that the probe passed there,
    which the next render reads to keep the cache on."""
    from b70ctl.serve.render import ServeContext, render_serve
    from b70ctl.serve.tuned import apply_tuned, parse_tuned, probe_passed

    corrupting = RenderedCacheServing(corrupt=True, rates={True: 400.0, False: 200.0})
    report = run_tune(HYBRID, corrupting, tmp_path / "corrupt")
    write_tune_outputs(report, tmp_path / "corrupt")
    on = next(c for c in report.candidates if c.overrides["prefix_caching"] == "on")
    assert "--enable-prefix-caching" in corrupting.argvs[on.label]
    assert corrupting.argvs[next(c.label for c in report.candidates if c.overrides["prefix_caching"] is None)] \
        == corrupting.argvs[next(c.label for c in report.candidates if c.overrides["prefix_caching"] == "off")]
    assert on.disqualified and on.disqualified.startswith("the gate against silent garbage:"), on.disqualified
    assert "first difference at generated token 5" in on.disqualified
    tuned = yaml.safe_load((tmp_path / "corrupt" / "b70_tuned.yml").read_text())["vllm_serve_tuned"]
    assert tuned["overrides"].get("prefix_caching") != "on" and not probe_passed(parse_tuned(json.dumps(tuned)))

    honest = RenderedCacheServing(corrupt=False, rates={True: 400.0, False: 200.0})
    report = run_tune(HYBRID, honest, tmp_path / "honest")
    write_tune_outputs(report, tmp_path / "honest")
    assert report.outcome == "tuned" and report.tuned_overrides["prefix_caching"] == "on"
    text = (tmp_path / "honest" / "b70_tuned.yml").read_text()
    tuned_settings = parse_tuned(json.dumps(yaml.safe_load(text)["vllm_serve_tuned"]))
    assert probe_passed(tuned_settings)
    served, _ = apply_tuned(HYBRID, tuned_settings, None)
    context = ServeContext(model_dir="/models/target", drafter_dir="/models/drafter", prefix_cache_probe_passed=True)
    command = render_serve(served, context)
    assert "--enable-prefix-caching" in command.argv and command.prefix_caching.startswith("on: the gate's")
    # Without the tune's record the same recipe serves with the cache off.
    assert "--no-enable-prefix-caching" in render_serve(HYBRID, context.model_copy(
        update={"prefix_cache_probe_passed": False})).argv


def test_the_hosts_tune_record_turns_the_cache_on_through_serve_render(tmp_path):
    """`b70ctl serve render --tuned` (what roles/vllm_serve runs with host_vars' vllm_serve_tuned): a winner with
    prefix caching on is the host's probe record; any other tune leaves the cache off."""
    from typer.testing import CliRunner

    from b70ctl.cli import app
    from b70host.topology import TOPOLOGY_PATH, topology
    from sysfs_trees import build_tree

    root = build_tree(tmp_path, "b70x2-switch")
    topology(root, 2, probe="never", write=True)
    written = str(Path(root) / TOPOLOGY_PATH.lstrip("/"))

    def flags(tuned: dict) -> list[str]:
        done = CliRunner().invoke(app, ["serve", "render", "--recipe", "mtp3-int4-tp2", "--topology", written,
                                        "--json", "--tuned", json.dumps(tuned)])
        assert done.exit_code == 0, done.output
        return [word for word in json.loads(done.stdout)["argv"] if "prefix-caching" in word]

    base = {"recipe": "mtp3-int4-tp2", "outcome": "tuned", "budget_requests": 40, "spent_requests": 40,
            "date": "2026-12-07"}
    assert flags(base | {"overrides": {"num_speculative_tokens": 3, "prefix_caching": "on"}}) == \
        ["--enable-prefix-caching"]
    assert flags(base | {"overrides": {"num_speculative_tokens": 4, "prefix_caching": None}}) == \
        ["--no-enable-prefix-caching"]
    assert flags({}) == ["--no-enable-prefix-caching"]
