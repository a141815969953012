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
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from b70ctl.checks.client import Endpoint, EndpointError, VllmClient
from b70ctl.checks.correctness import Reference, load_reference, record_reference, run_correctness
from b70ctl.checks.gate import compare_after_restart, load_answers, make_decoder, replay, run_gate, save_answers
from b70ctl.checks.throughput import run_throughput
from b70ctl.errors import BadInput
from b70ctl.recipes.model import Recipe, TuneSpace
from b70ctl.report.model import CorrectnessResult, Environment, RooflineInput, RooflineInputs
from b70ctl.report.roofline import bandwidth_input, memory_domains, weight_input, weights_bound
from b70ctl.tune.model import (
    Candidate,
    CandidateResult,
    FinalComparison,
    Measurement,
    PublishedRecord,
    RaceRoofline,
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
        elif name == "prefix_caching":
            # What the host serves: the recipe's setting as the render decides it for this host (a speculating
            # hybrid target keeps the cache only once the probe passed there, serve/render.py prefix_caching).
            values[name] = None
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


@dataclass(frozen=True)
class Entrant:
    """A recipe in the tune, and who serves it. A one-recipe tune has one; a race (`tune --recipe A --recipe B`)
    one per recipe, the host's own first."""

    recipe: Recipe
    servers: CandidateServers
    # The roofline inputs read on the host for this recipe's own target, where it differs from the host recipe's
    # (playbooks/tune.yml reads them beside the raced recipe's models); None: the host recipe's inputs hold.
    roofline_inputs: RooflineInputs | None = None


def same_baseline(one: Recipe, other: Recipe) -> bool:
    """Whether two recipes' target-only baselines answer the same greedy questions with the same weights: same
    target, image, vLLM line, dtype, context and correctness set (speculation, which the baseline does not run,
    may differ). Such recipes share one recorded reference instead of starting the baseline again."""
    return (one.target == other.target and one.image == other.image and one.vllm_version == other.vllm_version
            and one.serve.dtype == other.serve.dtype and one.serve.max_model_len == other.serve.max_model_len
            and one.serve.baseline_tensor_parallel_size == other.serve.baseline_tensor_parallel_size
            and one.correctness == other.correctness)


class CandidateMeasurer:
    """Serves a candidate, checks greedy correctness the first time it is served, and measures the race's
    workload mix (the host recipe's endpoint workloads, the same for every candidate) with verify's throughput
    check."""

    def __init__(self, entrants: list[Entrant], references: dict[str, Reference], out_dir: Path,
                 progress: Progress):
        self.entrants = {entrant.recipe.name: entrant for entrant in entrants}
        self.host = entrants[0].recipe
        self.references, self.out_dir, self.progress = references, out_dir, progress
        self.checked: set[str] = set()

    def entrant(self, candidate: Candidate) -> Entrant:
        return self.entrants[candidate.recipe or self.host.name]

    def __call__(self, candidate: Candidate, stage: str, requests_per_workload: int) -> Measurement:
        raw_dir = self.out_dir / "raw" / stage / slug(candidate.label)
        entrant = self.entrant(candidate)
        tuned = entrant.recipe.with_overrides(candidate.overrides)
        self.progress(f"{stage}: {candidate.label}: serving")
        correctness = gate = None
        try:
            with entrant.servers.candidate(candidate) as endpoint, VllmClient(endpoint) as client:
                if candidate.key not in self.checked:
                    reference = self.references[entrant.recipe.name]
                    result = run_correctness(client, tuned, reference, raw_dir)
                    correctness, reason = correctness_verdict(result, required_identical_fraction(entrant.recipe))
                    if reason is None:
                        gate, reason = self.first_gate(client, tuned, reference, candidate, raw_dir)
                    if reason is not None:
                        self.progress(f"{stage}: {candidate.label}: disqualified: {reason}")
                        return Measurement(candidate=candidate.key, stage=stage, correctness=correctness, gate=gate,
                                           disqualified=reason, measured_at=datetime.now(UTC))
                    self.checked.add(candidate.key)
                else:
                    gate, reason = self.gate_after_restart(client, candidate)
                    if reason is not None:
                        self.progress(f"{stage}: {candidate.label}: disqualified: {reason}")
                        return Measurement(candidate=candidate.key, stage=stage, gate=gate, disqualified=reason,
                                           measured_at=datetime.now(UTC))
                self.progress(f"{stage}: {candidate.label}: {correctness or 'correctness checked earlier'}; "
                              f"{gate}; measuring {requests_per_workload} request(s) per workload")
                measured_recipe = round_recipe(with_workloads_of(tuned, self.host), requests_per_workload)
                throughput = run_throughput(client, measured_recipe, raw_dir,
                                            progress=lambda message: self.progress(f"{stage}: {candidate.label}: "
                                                                                   f"{message}"))
        except CandidateFailed as not_started:
            return Measurement(candidate=candidate.key, stage=stage, correctness=correctness, gate=gate,
                               disqualified=f"the server did not start: {not_started.reason}",
                               measured_at=datetime.now(UTC))
        except EndpointError as error:
            return Measurement(candidate=candidate.key, stage=stage, correctness=correctness, gate=gate,
                               disqualified=f"the server failed: {error.reason}", measured_at=datetime.now(UTC))
        requests = [r for w in throughput.workloads for r in w.requests]
        failed = next((w for w in throughput.workloads if w.error is not None), None)
        rates = [r.decode_tok_s for r in requests if r.decode_tok_s is not None]
        acceptance = {w.name: w.spec_decode.mean_acceptance_length for w in throughput.workloads
                      if w.spec_decode is not None and not w.spec_decode.polluted
                      and w.spec_decode.mean_acceptance_length is not None}
        return Measurement(
            candidate=candidate.key, stage=stage, requests=len(requests), decode_tok_s=rates,
            client_timed=sum(1 for r in requests if r.timing_source != "engine"), correctness=correctness, gate=gate,
            disqualified=(f"workload {failed.name} failed: {failed.error}" if failed is not None else None),
            mean_acceptance_length=acceptance, measured_at=datetime.now(UTC))

    def answers_path(self, candidate: Candidate) -> Path:
        return self.out_dir / "gate" / f"{slug(candidate.label)}.json"

    def first_gate(self, client: VllmClient, recipe: Recipe, reference: Reference, candidate: Candidate,
                   raw_dir: Path) -> tuple[str, str | None]:
        """The gate against silent garbage at a candidate's first serve: repetition, the prefix-cache probe, the
        canary and runs of one token (checks/gate.py). Its answers are kept: every later serve of the candidate
        is a restart, asked the same prompts (gate_after_restart)."""
        result = run_gate(client, recipe, raw_dir, baseline=reference)
        failed = next((check for check in result.checks if check.passed is False), None)
        if failed is not None:
            return f"gate failed: {failed.name}", f"the gate against silent garbage: {failed.detail}"
        if result.answers is not None:
            save_answers(result.answers, self.answers_path(candidate))
        passed = [check.name for check in result.checks if check.passed]
        return f"gate passed ({', '.join(passed)})", None

    def gate_after_restart(self, client: VllmClient, candidate: Candidate) -> tuple[str | None, str | None]:
        """A later serve of a candidate is a fresh server: the first serve's gate prompts must give the same tokens."""
        path = self.answers_path(candidate)
        if not path.exists():  # a state file from before the gate: nothing to compare with
            return None, None
        earlier = load_answers(path)
        check = compare_after_restart(earlier, replay(client, earlier), make_decoder(client))
        if check.passed is False:
            return "gate failed: restart", f"the gate against silent garbage: {check.detail}"
        return "same tokens after a restart", None


def with_workloads_of(recipe: Recipe, host: Recipe) -> Recipe:
    """The recipe measured on the host recipe's workloads: in a race every candidate runs the same requests."""
    if recipe.name == host.name:
        return recipe
    return recipe.model_copy(update={"workloads": host.workloads})


def reference_file(entrant: Recipe, racing: bool) -> str:
    return f"reference-{slug(entrant.name)}.json" if racing else REFERENCE_FILE


def references_for(entrants: list[Entrant], out_dir: Path, progress: Progress) -> dict[str, Reference]:
    """Each recipe's target-only greedy outputs, recorded once per tune (a resumed tune reuses the files); in a
    race, recipes whose baselines are the same server (same_baseline) share one recording. Each baseline stops
    before anything else starts, so no candidate is measured beside another server."""
    racing = len(entrants) > 1
    references: dict[str, Reference] = {}
    recorded: list[tuple[Recipe, Reference]] = []
    for entrant in entrants:
        recipe = entrant.recipe
        shared = next((reference for other, reference in recorded if same_baseline(other, recipe)), None)
        if shared is not None:
            references[recipe.name] = shared.model_copy(update={"recipe": recipe.name})
            references[recipe.name]._source = shared._source
            continue
        path = out_dir / reference_file(recipe, racing)
        if path.exists():
            reference = load_reference(path, recipe)
        else:
            progress("recording the target-only baseline's greedy outputs"
                     + (f" for {recipe.name}" if racing else ""))
            with entrant.servers.baseline() as endpoint, VllmClient(endpoint) as client:
                reference = record_reference(client, recipe, path)
        references[recipe.name] = reference
        recorded.append((recipe, reference))
    return references


def reference_for(recipe: Recipe, servers: CandidateServers, out_dir: Path, progress: Progress) -> Reference:
    """The target-only baseline's greedy outputs of a one-recipe tune (reference.json)."""
    return references_for([Entrant(recipe, servers)], out_dir, progress)[recipe.name]


def race_candidates(entrants: list[Entrant], profile: str | None) -> tuple[list[Candidate], Candidate]:
    """Every entrant's candidates (a recipe without a tune section is one candidate: itself), and the host
    recipe's default, against which the winner is measured back to back. In a race each names its recipe."""
    racing = len(entrants) > 1
    everyone: list[Candidate] = []
    host_default: Candidate | None = None
    for entrant in entrants:
        if entrant.recipe.tune is not None:
            grid, default = candidates_of(entrant.recipe, profile)
        else:
            grid = [default := Candidate(overrides={})]
        if racing:
            grid = [candidate.model_copy(update={"recipe": entrant.recipe.name}) for candidate in grid]
            default = default.model_copy(update={"recipe": entrant.recipe.name})
        everyone += grid
        host_default = host_default or default
    assert host_default is not None
    return everyone, host_default


def race_settings(entrants: list[Entrant]) -> TuneSpace:
    """The halving's settings: the host recipe's tune section, else the first raced recipe that has one."""
    settings = next((entrant.recipe.tune for entrant in entrants if entrant.recipe.tune is not None), None)
    if settings is None:
        names = ", ".join(entrant.recipe.name for entrant in entrants)
        raise BadInput(f"recipe {names} has no tune section: nothing may be tuned" if len(entrants) == 1 else
                       f"none of the raced recipes ({names}) has a tune section, which sets the race's budget: "
                       "race at least one recipe that has one")
    return settings


def check_entrants(entrants: list[Entrant]) -> None:
    names = [entrant.recipe.name for entrant in entrants]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise BadInput(f"--recipe {repeated[0]} is given twice: race each recipe once")
    host = entrants[0].recipe
    for entrant in entrants[1:]:
        if entrant.recipe.host.accelerator != host.host.accelerator:
            raise BadInput(f"--recipe {entrant.recipe.name} runs on {entrant.recipe.host.accelerator} hosts, "
                           f"{host.name} on {host.host.accelerator}: race recipes for the same hardware")


def tune_plan(recipe: Recipe, profile: str | None = None, budget_requests: int | None = None
              ) -> tuple[list[Candidate], Candidate, list[PlannedRound], int]:
    """The candidates, the recipe's default, the halving's rounds and the budget: refused (BadInput) before
    anything is served when the budget cannot cover one round and the final."""
    return race_plan([recipe], profile, budget_requests)


def race_plan(recipes: list[Recipe], profile: str | None = None, budget_requests: int | None = None
              ) -> tuple[list[Candidate], Candidate, list[PlannedRound], int]:
    """tune_plan for one recipe or a race of several (the host's first)."""
    entrants = [Entrant(recipe, _NoServers()) for recipe in recipes]
    check_entrants(entrants)
    tune = race_settings(entrants)
    candidates, default = race_candidates(entrants, profile)
    budget = budget_requests or tune.budget_requests
    plan = plan_rounds(len(candidates), len(measured_workloads(recipes[0])), tune.first_rung_requests,
                       tune.final_requests, budget)
    return candidates, default, plan, budget


class _NoServers:
    """Planning serves nothing."""

    def baseline(self) -> AbstractContextManager[Endpoint]:
        raise AssertionError("planning serves nothing")

    def candidate(self, candidate: Candidate) -> AbstractContextManager[Endpoint]:
        raise AssertionError("planning serves nothing")


def run_tune(recipe: Recipe, servers: CandidateServers, out_dir: Path, progress: Progress | None = None,
             profile: str | None = None, budget_requests: int | None = None,
             roofline_inputs: RooflineInputs | None = None) -> TuneReport:
    return run_race([Entrant(recipe, servers)], out_dir, progress, profile, budget_requests, roofline_inputs)


def run_race(entrants: list[Entrant], out_dir: Path, progress: Progress | None = None,
             profile: str | None = None, budget_requests: int | None = None,
             roofline_inputs: RooflineInputs | None = None) -> TuneReport:
    """A tune of one recipe, or a race of several on the same host: every candidate of every recipe in one
    successive halving on the same workloads and budget, the winner then measured back to back against the host
    recipe's default."""
    report = progress or (lambda _message: None)
    out_dir = Path(out_dir)
    started_at = datetime.now(UTC)
    recipes = [entrant.recipe for entrant in entrants]
    candidates, default, plan, budget = race_plan(recipes, profile, budget_requests)
    tune = race_settings(entrants)
    host = recipes[0]
    workloads = measured_workloads(host)
    space = {"recipe": host.name, "vllm_version": host.vllm_version, "profile": profile,
             "candidates": [c.key for c in candidates], "workloads": [w.model_dump(mode="json")
                                                                     for w in host.workloads if w.name in workloads],
             "correctness": host.correctness.model_dump(mode="json"), "budget_requests": budget,
             "first_rung_requests": tune.first_rung_requests, "final_requests": tune.final_requests}
    if len(entrants) > 1:  # a one-recipe tune's space is what it was before races, so its state files resume
        space["race"] = [{"recipe": r.name, "vllm_version": r.vllm_version,
                          "correctness": r.correctness.model_dump(mode="json")} for r in recipes]
    state = TuneState(out_dir / STATE_FILE, space)
    if state.resumed:
        report(f"resuming: {state.resumed} measurement(s) already in {state.path}")
    references = references_for(entrants, out_dir, report)
    measure = CandidateMeasurer(entrants, references, out_dir, report)
    measure.checked.update(key for (key, _), m in state.measurements.items()
                           if m.correctness is not None and m.disqualified is None)
    halving = successive_halving(candidates, plan, measure, state)
    final = None
    if halving.winner is not None:
        default_final, winner_final = final_comparison(halving.winner, default, measure, state, tune.final_requests)
        final = FinalComparison(default_key=default.key, winner_key=halving.winner.key,
                                default=figures(default_final.decode_tok_s) if default_final else None,
                                winner=figures(winner_final.decode_tok_s))
    own = {entrant.recipe.name: entrant.roofline_inputs for entrant in entrants if entrant.roofline_inputs}
    return build_report(recipes, profile, candidates, default, plan, halving.rounds, final, state, budget,
                        started_at, roofline_inputs, own)


def published_records(recipes: list[Recipe]) -> list[PublishedRecord]:
    """Each raced recipe's published decode rates (claims in tok/s, not ratios), with where they were published."""
    return [PublishedRecord(recipe=recipe.name, claim=claim.id, description=claim.description,
                            tok_s=claim.value, source=claim.source, url=claim.url)
            for recipe in recipes for claim in recipe.claims
            if claim.metric.endswith("decode_tok_s.median") and claim.divided_by is None and claim.op == ">="
            and claim.value is not None]


def acceptance_length(recipe: Recipe, measurements: list[Measurement]) -> float | None:
    """Tokens per decode step of a candidate: 1 without speculation, else the mean of what its measurements'
    counters gave per workload (None when they gave none)."""
    if recipe.serve.speculative is None:
        return 1.0
    lengths = [length for m in measurements for length in m.mean_acceptance_length.values()]
    return sum(lengths) / len(lengths) if lengths else None


def race_roofline(recipes: list[Recipe], inputs: RooflineInputs | None,
                  own: dict[str, RooflineInputs] | None = None
                  ) -> tuple[RaceRoofline, dict[str, tuple[RooflineInput, RooflineInput]]]:
    """The roofline's inputs on this host, and per recipe its bandwidth and weights per memory domain: the host's
    memory bandwidth for every recipe, and each recipe's target shape from the inputs read for its own target
    (OWN, by recipe name), else from the host recipe's when it serves the same target, else not measured."""
    own = own or {}
    host = Environment()
    if inputs is None:
        host.target_shape_unavailable = ("the serving host's roofline inputs were not given (b70ctl tune "
                                         "--roofline-inputs: the JSON b70host/roofline_inputs.py printed there)")
        host.memory_bandwidth_unavailable = host.target_shape_unavailable
    else:
        host = Environment(target_shape=inputs.target_shape, target_shape_unavailable=inputs.target_shape_unavailable,
                           memory_bandwidth=inputs.memory_bandwidth,
                           memory_bandwidth_unavailable=inputs.memory_bandwidth_unavailable)

    def environment(recipe: Recipe) -> Environment:
        if recipe.name in own:
            read = own[recipe.name]
            return host.model_copy(update={"target_shape": read.target_shape,
                                           "target_shape_unavailable": read.target_shape_unavailable})
        if recipe.target == recipes[0].target:
            return host
        return host.model_copy(update={"target_shape": None, "target_shape_unavailable": (
            f"{recipe.name}'s target was not read on the host (playbooks/tune.yml reads it beside the raced "
            "recipe's models)")})

    per_recipe = {}
    for recipe in recipes:
        seen = environment(recipe)
        per_recipe[recipe.name] = (bandwidth_input(recipe, seen), weight_input(seen, memory_domains(recipe)))
    host_bandwidth, _ = per_recipe[recipes[0].name]
    missing = [one.source for bandwidth, weights in per_recipe.values() for one in (bandwidth, weights)
               if one.value is None]
    roofline = RaceRoofline(bandwidth_bytes_per_s=host_bandwidth, weight_bytes=weight_input(host, 1),
                            not_measured="; ".join(dict.fromkeys(reason.removeprefix("not measured: ")
                                                                 for reason in missing)) or None)
    return roofline, per_recipe


def build_report(recipes: list[Recipe], profile: str | None, candidates: list[Candidate], default: Candidate,
                 plan: list[PlannedRound], rounds: list[Round], final: FinalComparison | None, state: TuneState,
                 budget: int, started_at: datetime, roofline_inputs: RooflineInputs | None = None,
                 own_roofline_inputs: dict[str, RooflineInputs] | None = None) -> TuneReport:
    recipe = recipes[0]
    racing = len(recipes) > 1
    by_name = {one.name: one for one in recipes}
    roofline, per_recipe = race_roofline(recipes, roofline_inputs, own_roofline_inputs)
    results = []
    for candidate in candidates:
        measurements = [m for m in state.of(candidate.key) if m.stage.startswith("round-")]
        served = by_name[candidate.recipe or recipe.name].with_overrides(candidate.overrides)
        acceptance = acceptance_length(served, [m for m in measurements if m.requests])
        bandwidth, weights = per_recipe[candidate.recipe or recipe.name]
        results.append(CandidateResult(
            mean_acceptance_length=acceptance, bound_tok_s=weights_bound(bandwidth, weights, acceptance),
            key=candidate.key, label=candidate.label, recipe=candidate.recipe, overrides=candidate.overrides,
            is_default=candidate.key == default.key, rounds=len(measurements),
            halving=figures(halving_rates(state, candidate)),
            correctness=next((m.correctness for m in state.of(candidate.key) if m.correctness), None),
            gate=next((m.gate for m in state.of(candidate.key) if m.gate), None),
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
    winner_recipe = None
    if racing:
        winner_recipe = (by_key[final.winner_key].recipe if final is not None and outcome == "tuned"
                         else recipe.name)
    return TuneReport(
        recipe=recipe.name, race=[r.name for r in recipes] if racing else [],
        published=published_records(recipes) if racing else [], winner_recipe=winner_recipe,
        vllm_version=recipe.vllm_version, profile=profile, knobs=knobs,
        default_overrides=default.overrides, workloads=measured_workloads(recipe), budget_requests=budget,
        spent_requests=state.spent_requests, started_at=started_at, finished_at=datetime.now(UTC), rounds=rounds,
        candidates=results, final=final, roofline=roofline, outcome=outcome, tuned_overrides=tuned,
        summary=summary)


def applied(winner: Candidate) -> dict[str, int | str | None]:
    """The winner's overrides as b70_tuned.yml carries them: without an n-gram window it does not use."""
    return {name: value for name, value in winner.overrides.items() if knob_applies(name, winner.overrides)}


def _tok(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} tok/s"
