"""Successive halving under a request budget.

Round 0 measures every candidate with a few requests per workload; each later round keeps the better half (by the
robust score over all of a candidate's requests so far) and doubles the requests. The rounds are planned up front
from the budget, the final back-to-back re-measurement of the winner and the recipe's default reserved first, so
the tune never measures more requests than the budget. A disqualified candidate (greedy output differs from the
target-only baseline, server did not start, a workload failed) is out whatever its speed. Nothing is inferred from
the acceptance curve: every ranking is of measured rates.

`measure` is whatever serves and measures a candidate; measurements already in the state are not taken again,
which is how an interrupted tune resumes: the rounds replay from the state and measure only what is missing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from b70ctl.errors import BadInput
from b70ctl.report.stats import mad, median
from b70ctl.tune.model import Candidate, Figures, Measurement, Round
from b70ctl.tune.score import robust_score
from b70ctl.tune.state import TuneState

Measure = Callable[[Candidate, str, int], Measurement]


@dataclass(frozen=True)
class PlannedRound:
    index: int
    slots: int  # most candidates measured in it
    requests_per_workload: int

    def cost(self, workloads: int) -> int:
        return self.slots * self.requests_per_workload * workloads


def final_cost(workloads: int, final_requests: int) -> int:
    return 2 * final_requests * workloads


def plan_rounds(candidates: int, workloads: int, first_round_requests: int, final_requests: int,
                budget_requests: int) -> list[PlannedRound]:
    """The halving's rounds that fit the budget next to the final re-measurement. Halving stops when one
    candidate would be left, or when the next round would overrun the budget."""
    left = budget_requests - final_cost(workloads, final_requests)
    rounds: list[PlannedRound] = []
    slots, requests = candidates, first_round_requests
    while True:
        planned = PlannedRound(len(rounds), slots, requests)
        if planned.cost(workloads) > left:
            break
        rounds.append(planned)
        left -= planned.cost(workloads)
        if slots <= 2:
            break
        slots, requests = math.ceil(slots / 2), requests * 2
    if not rounds:
        raise BadInput(f"a budget of {budget_requests} requests does not cover one round of {candidates} candidates "
                       f"x {first_round_requests} request(s) x {workloads} workloads and the final "
                       f"{final_cost(workloads, final_requests)}: raise tune.budget_requests")
    return rounds


def figures(rates: Sequence[float]) -> Figures:
    if not rates:
        return Figures(n=0)
    return Figures(n=len(rates), median_tok_s=median(rates), mad_tok_s=mad(rates), score_tok_s=robust_score(rates))


def halving_rates(state: TuneState, candidate: Candidate) -> list[float]:
    return [rate for m in state.of(candidate.key) if m.stage.startswith("round-") for rate in m.decode_tok_s]


def disqualification(state: TuneState, candidate: Candidate) -> str | None:
    return next((m.disqualified for m in state.of(candidate.key) if m.disqualified), None)


def measured(state: TuneState, measure: Measure, candidate: Candidate, stage: str, requests: int) -> Measurement:
    done = state.get(candidate.key, stage)
    if done is None:
        done = measure(candidate, stage, requests)
        state.add(done)
    return done


@dataclass
class HalvingResult:
    rounds: list[Round]
    winner: Candidate | None


def successive_halving(candidates: Sequence[Candidate], plan: Sequence[PlannedRound], measure: Measure,
                       state: TuneState) -> HalvingResult:
    alive = list(candidates)
    order = {candidate.key: index for index, candidate in enumerate(candidates)}
    rounds: list[Round] = []
    for planned in plan:
        stage = f"round-{planned.index}"
        batch = alive[:planned.slots]
        for candidate in batch:
            if disqualification(state, candidate) is None:
                measured(state, measure, candidate, stage, planned.requests_per_workload)
        qualified = [c for c in batch if disqualification(state, c) is None and halving_rates(state, c)]
        # Best score first; equal scores keep the candidates' order, so a replay ranks exactly as the first run.
        ranked = sorted(qualified, key=lambda c: (-(robust_score(halving_rates(state, c)) or 0.0), order[c.key]))
        keep = ranked[:max(1, math.ceil(len(batch) / 2))] if planned is not plan[-1] else ranked[:1]
        rounds.append(Round(index=planned.index, requests_per_workload=planned.requests_per_workload,
                            measured=[c.key for c in batch], kept=[c.key for c in keep]))
        alive = keep
        if not alive:
            break
    return HalvingResult(rounds=rounds, winner=alive[0] if alive else None)


def final_comparison(winner: Candidate, default: Candidate, measure: Measure, state: TuneState,
                     final_requests: int) -> tuple[Measurement | None, Measurement]:
    """The default, then the winner, measured back to back with the same requests (one window: the machine's
    drift between the halving's rounds does not decide). A disqualified default is not measured again."""
    default_measurement = None
    if disqualification(state, default) is None:
        default_measurement = measured(state, measure, default, "final", final_requests)
    if winner.key == default.key:
        assert default_measurement is not None
        return default_measurement, default_measurement
    return default_measurement, measured(state, measure, winner, "final", final_requests)
