"""One tune on one host: the space from the recipe, the greedy reference from the target-only baseline, the
halving, the final same-window comparison, and the report files.

Files in the output directory: tune-state.jsonl (every measurement, the resume point), reference.json (the
baseline's greedy outputs, recorded once), raw/<stage>/<candidate>/ (verify's raw data of every request),
tune.json, tune.md, tune-scores.svg and b70_tuned.yml (the overrides to apply, with the score, the budget and the
date: what the appliance places in host_vars/<host>/).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from b70ctl.checks.client import EndpointError, VllmClient
from b70ctl.checks.correctness import Reference, load_reference, record_reference, run_correctness
from b70ctl.checks.throughput import run_throughput
from b70ctl.errors import BadInput
from b70ctl.recipes.model import Recipe
from b70ctl.report.model import CorrectnessResult
from b70ctl.tune.model import (
    Candidate,
    CandidateResult,
    FinalComparison,
    Measurement,
    Round,
    TuneReport,
    Value,
    knob_applies,
)
from b70ctl.tune.search import (
    PlannedRound,
    disqualification,
    figures,
    final_comparison,
    halving_rates,
    plan_rounds,
    successive_halving,
)
from b70ctl.tune.serving import CandidateFailed, CandidateServers
from b70ctl.tune.state import STATE_FILE, TuneState

Progress = Callable[[str], None]

REFERENCE_FILE = "reference.json"


def default_overrides(recipe: Recipe, knobs: dict[str, list[int | str]], profile: str | None = None
                      ) -> dict[str, int | str | None]:
    """The recipe's own value of every tuned knob (None: vLLM's default, the recipe sets nothing)."""
    spec = recipe.serve.speculative
    values: dict[str, int | str | None] = {}
    for name in knobs:
        if name in ("method", "num_speculative_tokens", "draft_sample_method", "prompt_lookup_min",
                    "prompt_lookup_max"):
            values[name] = getattr(spec, name) if spec is not None else None
        elif name == "max_num_batched_tokens":
            values[name] = recipe.serve.max_num_batched_tokens
        else:  # a oneCCL threshold: the active profile's value
            from b70host.topology import CCL_PROFILES

            value = CCL_PROFILES.get(profile or "", {}).get("env", {}).get(name)
            values[name] = int(value) if value is not None else None
    return values


def candidates_of(recipe: Recipe, profile: str | None) -> tuple[list[Candidate], Candidate]:
    """The grid of the recipe's tune space, and the recipe's default (added to the grid when it is not on it)."""
    if recipe.tune is None:
        raise BadInput(f"recipe {recipe.name} has no tune section: nothing may be tuned")
    knobs = recipe.tune.knobs(profile)
    own = default_overrides(recipe, knobs, profile)
    # Every candidate names every knob, a knob its combination leaves out at the recipe's value (an ngram
    # candidate's batched tokens, a draft-model candidate's method): one key per setting actually served.
    grid = [Candidate(overrides={name: overrides.get(name, own[name]) for name in knobs})
            for overrides in recipe.tune.grid(profile)]
    default = Candidate(overrides=own)
    if default.key not in {candidate.key for candidate in grid}:
        grid.append(default)
    return grid, default


def knobs_tried(candidates: list[Candidate]) -> dict[str, list[int | str | None]]:
    """Knob -> the values the candidates were served with, in first-seen order (the recipe's own method and
    the default's values included, a knob that does not apply to a candidate left out)."""
    knobs: dict[str, list[int | str | None]] = {}
    for candidate in candidates:
        for name, value in candidate.overrides.items():
            values = knobs.setdefault(name, [])
            if knob_applies(name, candidate.overrides) and value not in values:
                values.append(value)
    return knobs


def measured_workloads(recipe: Recipe) -> list[str]:
    """The recipe's workload mix as the served endpoint sees it (baseline workloads measure the baseline)."""
    return [workload.name for workload in recipe.workloads if workload.server == "endpoint"]


def round_recipe(recipe: Recipe, requests_per_workload: int) -> Recipe:
    """The recipe with its endpoint workloads only, each run for exactly this many measured requests."""
    workloads = [workload.model_copy(update={"min_requests": requests_per_workload,
                                             "max_requests": requests_per_workload})
                 for workload in recipe.workloads if workload.server == "endpoint"]
    return recipe.model_copy(update={"workloads": workloads})


def required_identical_fraction(recipe: Recipe) -> float:
    """The recipe's own bound on greedy identity (its claim, with tolerance), else every output identical."""
    for claim in recipe.claims:
        if claim.metric == "correctness.identical_fraction" and claim.op == ">=" and claim.value is not None:
            return claim.value - claim.tolerance.slack(claim.value)
    return 1.0


def correctness_verdict(result: CorrectnessResult, required: float) -> tuple[str, str | None]:
    shown = f"{result.identical}/{result.total} identical"
    if result.reason is not None:
        return shown, f"greedy correctness could not be checked: {result.reason}"
    if result.garbage:
        return shown, f"garbage output: {result.garbage[0].detail}"
    if result.total == 0 or result.identical_fraction < required:
        return shown, (f"greedy outputs differ from the target-only baseline ({shown}, the recipe requires "
                       f"{required:.0%})")
    return shown, None


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=]+", "-", text).strip("-") or "default"


class CandidateMeasurer:
    """Serves a candidate, checks greedy correctness the first time it is served, and measures the workload mix
    with verify's throughput check."""

    def __init__(self, recipe: Recipe, servers: CandidateServers, reference: Reference, out_dir: Path,
                 progress: Progress):
        self.recipe, self.servers, self.reference = recipe, servers, reference
        self.out_dir, self.progress = out_dir, progress
        self.required = required_identical_fraction(recipe)
        self.checked: set[str] = set()

    def __call__(self, candidate: Candidate, stage: str, requests_per_workload: int) -> Measurement:
        raw_dir = self.out_dir / "raw" / stage / slug(candidate.label)
        tuned = self.recipe.with_overrides(candidate.overrides)
        self.progress(f"{stage}: {candidate.label}: serving")
        correctness = None
        try:
            with self.servers.candidate(candidate) as endpoint, VllmClient(endpoint) as client:
                if candidate.key not in self.checked:
                    result = run_correctness(client, tuned, self.reference, raw_dir)
                    correctness, reason = correctness_verdict(result, self.required)
                    if reason is not None:
                        self.progress(f"{stage}: {candidate.label}: disqualified: {reason}")
                        return Measurement(candidate=candidate.key, stage=stage, correctness=correctness,
                                           disqualified=reason, measured_at=datetime.now(UTC))
                    self.checked.add(candidate.key)
                self.progress(f"{stage}: {candidate.label}: {correctness or 'correctness checked earlier'}; "
                              f"measuring {requests_per_workload} request(s) per workload")
                throughput = run_throughput(client, round_recipe(tuned, requests_per_workload), raw_dir,
                                            progress=lambda message: self.progress(f"{stage}: {candidate.label}: "
                                                                                   f"{message}"))
        except CandidateFailed as not_started:
            return Measurement(candidate=candidate.key, stage=stage, correctness=correctness,
                               disqualified=f"the server did not start: {not_started.reason}",
                               measured_at=datetime.now(UTC))
        except EndpointError as error:
            return Measurement(candidate=candidate.key, stage=stage, correctness=correctness,
                               disqualified=f"the server failed: {error.reason}", measured_at=datetime.now(UTC))
        requests = [r for w in throughput.workloads for r in w.requests]
        failed = next((w for w in throughput.workloads if w.error is not None), None)
        rates = [r.decode_tok_s for r in requests if r.decode_tok_s is not None]
        acceptance = {w.name: w.spec_decode.mean_acceptance_length for w in throughput.workloads
                      if w.spec_decode is not None and not w.spec_decode.polluted
                      and w.spec_decode.mean_acceptance_length is not None}
        return Measurement(
            candidate=candidate.key, stage=stage, requests=len(requests), decode_tok_s=rates,
            client_timed=sum(1 for r in requests if r.timing_source != "engine"), correctness=correctness,
            disqualified=(f"workload {failed.name} failed: {failed.error}" if failed is not None else None),
            mean_acceptance_length=acceptance, measured_at=datetime.now(UTC))


def reference_for(recipe: Recipe, servers: CandidateServers, out_dir: Path, progress: Progress) -> Reference:
    """The target-only baseline's greedy outputs, recorded once per tune (a resumed tune reuses them): the
    baseline then stops, so no candidate is measured while it shares the machine with another server."""
    path = out_dir / REFERENCE_FILE
    if path.exists():
        return load_reference(path, recipe)
    progress("recording the target-only baseline's greedy outputs")
    with servers.baseline() as endpoint, VllmClient(endpoint) as client:
        return record_reference(client, recipe, path)


def tune_plan(recipe: Recipe, profile: str | None = None, budget_requests: int | None = None
              ) -> tuple[list[Candidate], Candidate, list[PlannedRound], int]:
    """The candidates, the recipe's default, the halving's rounds and the budget: refused (BadInput) before
    anything is served when the budget cannot cover one round and the final."""
    candidates, default = candidates_of(recipe, profile)
    assert recipe.tune is not None
    budget = budget_requests or recipe.tune.budget_requests
    plan = plan_rounds(len(candidates), len(measured_workloads(recipe)), recipe.tune.first_rung_requests,
                       recipe.tune.final_requests, budget)
    return candidates, default, plan, budget


def run_tune(recipe: Recipe, servers: CandidateServers, out_dir: Path, progress: Progress | None = None,
             profile: str | None = None, budget_requests: int | None = None) -> TuneReport:
    report = progress or (lambda _message: None)
    out_dir = Path(out_dir)
    started_at = datetime.now(UTC)
    candidates, default, plan, budget = tune_plan(recipe, profile, budget_requests)
    assert recipe.tune is not None
    tune = recipe.tune
    workloads = measured_workloads(recipe)
    space = {"recipe": recipe.name, "vllm_version": recipe.vllm_version, "profile": profile,
             "candidates": [c.key for c in candidates], "workloads": [w.model_dump(mode="json")
                                                                     for w in recipe.workloads if w.name in workloads],
             "correctness": recipe.correctness.model_dump(mode="json"), "budget_requests": budget,
             "first_rung_requests": tune.first_rung_requests, "final_requests": tune.final_requests}
    state = TuneState(out_dir / STATE_FILE, space)
    if state.resumed:
        report(f"resuming: {state.resumed} measurement(s) already in {state.path}")
    reference = reference_for(recipe, servers, out_dir, report)
    measure = CandidateMeasurer(recipe, servers, reference, out_dir, report)
    measure.checked.update(key for (key, _), m in state.measurements.items()
                           if m.correctness is not None and m.disqualified is None)
    halving = successive_halving(candidates, plan, measure, state)
    final = None
    if halving.winner is not None:
        default_final, winner_final = final_comparison(halving.winner, default, measure, state, tune.final_requests)
        final = FinalComparison(default_key=default.key, winner_key=halving.winner.key,
                                default=figures(default_final.decode_tok_s) if default_final else None,
                                winner=figures(winner_final.decode_tok_s))
    return build_report(recipe, profile, candidates, default, plan, halving.rounds, final, state, budget,
                        started_at)


def build_report(recipe: Recipe, profile: str | None, candidates: list[Candidate], default: Candidate,
                 plan: list[PlannedRound], rounds: list[Round], final: FinalComparison | None, state: TuneState,
                 budget: int, started_at: datetime) -> TuneReport:
    assert recipe.tune is not None
    results = []
    for candidate in candidates:
        measurements = [m for m in state.of(candidate.key) if m.stage.startswith("round-")]
        results.append(CandidateResult(
            key=candidate.key, label=candidate.label, overrides=candidate.overrides,
            is_default=candidate.key == default.key, rounds=len(measurements),
            halving=figures(halving_rates(state, candidate)),
            correctness=next((m.correctness for m in state.of(candidate.key) if m.correctness), None),
            disqualified=disqualification(state, candidate)))
    by_key = {c.key: c for c in candidates}
    tuned: dict[str, Value]
    if final is None:
        outcome, tuned, summary = "no_candidate", {}, "no candidate passed greedy correctness and its workloads"
    else:
        winner = by_key[final.winner_key]
        winner_score = final.winner.score_tok_s
        default_score = final.default.score_tok_s if final.default is not None else None
        if final.winner_key == final.default_key:
            outcome, tuned = "default_best", {}
            summary = (f"the recipe's default was already best: {default.label} won the halving "
                       f"(score {_tok(default_score)} in the final measurement)")
        elif default_score is None:
            outcome, tuned = "tuned", applied(winner)
            summary = (f"{winner.label}: score {_tok(winner_score)}; the recipe's default ({default.label}) was "
                       f"disqualified: {disqualification(state, default)}")
        elif winner_score is not None and winner_score > default_score:
            outcome, tuned = "tuned", applied(winner)
            gain = f" ({(winner_score / default_score - 1) * 100:+.1f}%)" if default_score > 0 else ""
            summary = (f"{winner.label} beats the recipe's default ({default.label}) measured back to back: "
                       f"score {_tok(winner_score)} against {_tok(default_score)}{gain}")
        else:
            outcome, tuned = "default_best", {}
            summary = (f"the recipe's default was already best: the halving's winner ({winner.label}) scored "
                       f"{_tok(winner_score)} against the default's {_tok(default_score)} measured back to back")
    knobs = knobs_tried(candidates)
    return TuneReport(
        recipe=recipe.name, vllm_version=recipe.vllm_version, profile=profile, knobs=knobs,
        default_overrides=default.overrides, workloads=measured_workloads(recipe), budget_requests=budget,
        spent_requests=state.spent_requests, started_at=started_at, finished_at=datetime.now(UTC), rounds=rounds,
        candidates=results, final=final, outcome=outcome, tuned_overrides=tuned, summary=summary)


def applied(winner: Candidate) -> dict[str, int | str | None]:
    """The winner's overrides as b70_tuned.yml carries them: without an n-gram window it does not use."""
    return {name: value for name, value in winner.overrides.items() if knob_applies(name, winner.overrides)}


def _tok(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} tok/s"
