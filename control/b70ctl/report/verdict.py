"""Verdicts: each published claim of the recipe against what was measured. Pure functions."""

from __future__ import annotations

import math

from b70ctl.recipes.model import Claim
from b70ctl.report.model import ClaimVerdict

Measurements = dict[str, float | list[float]]


def judge(claim: Claim, measurements: Measurements, unmeasurable: dict[str, str] | None = None) -> ClaimVerdict:
    """met / not_met / not_measured, with the figure and the reason. The tolerance widens the bound in the
    measurement's favour: a replication on another host is not expected to hit the published figure exactly."""
    measured = measurements.get(claim.metric)
    missing = claim.metric if measured is None else None
    if claim.divided_by is not None and measured is not None:
        denominator = measurements.get(claim.divided_by)
        if not isinstance(denominator, (int, float)) or isinstance(measured, list) or denominator <= 0:
            missing, measured = claim.divided_by, None
        else:
            measured = float(measured) / float(denominator)
    metric = claim.metric if claim.divided_by is None else f"{claim.metric} / {claim.divided_by}"
    base = {"claim_id": claim.id, "description": claim.description, "metric": metric,
            "bound": claim.describe_bound(), "source": claim.source, "url": claim.url, "measured": measured}
    if measured is None:
        # A figure of a step that could not measure it (a failed or unmeasurable workload) says why.
        why = next((f"{prefix}: {reason}" for prefix, reason in (unmeasurable or {}).items()
                    if missing is not None and missing.startswith(f"{prefix}.")), None)
        return ClaimVerdict(verdict="not_measured", reason=why or f"no measurement {missing} in this run", **base)
    figures = measured if isinstance(measured, list) else [measured]
    if not all(math.isfinite(float(figure)) for figure in figures):
        return ClaimVerdict(verdict="not_measured", reason=f"{metric} is not a finite number (a NaN or infinite "
                            "counter): nothing to judge", **base)

    tol = claim.tolerance
    if claim.op == "per_position":
        expected = claim.values or []
        if not isinstance(measured, list):
            return ClaimVerdict(verdict="not_measured", reason="expected one rate per position", **base)
        if len(measured) < len(expected):
            return ClaimVerdict(verdict="not_met", reason=f"measured {len(measured)} positions, the claim has "
                                f"{len(expected)}", **base)
        off = [(i, got, want) for i, (got, want) in enumerate(zip(measured, expected, strict=False))
               if abs(got - want) > tol.slack(want)]
        if off:
            i, got, want = off[0]
            return ClaimVerdict(verdict="not_met", reason=f"position {i}: {got:.3f} vs {want:.2f} "
                                f"({len(off)} of {len(expected)} positions outside tolerance)", **base)
        return ClaimVerdict(verdict="met", **base)

    if isinstance(measured, list):
        return ClaimVerdict(verdict="not_measured", reason="expected one figure, got a list", **base)
    value = float(measured)
    # Claim's validator requires value for >= and <=, and low and high for between.
    if claim.op == ">=":
        assert claim.value is not None
        bound = claim.value - tol.slack(claim.value)
        ok, reason = value >= bound, f"{value:.4g} < {bound:.4g}"
    elif claim.op == "<=":
        assert claim.value is not None
        bound = claim.value + tol.slack(claim.value)
        ok, reason = value <= bound, f"{value:.4g} > {bound:.4g}"
    else:
        assert claim.low is not None and claim.high is not None
        low = claim.low - tol.slack(claim.low)
        high = claim.high + tol.slack(claim.high)
        ok, reason = low <= value <= high, f"{value:.4g} outside {low:.4g} .. {high:.4g}"
    return ClaimVerdict(verdict="met" if ok else "not_met", reason=None if ok else reason, **base)


def judge_all(claims: list[Claim], measurements: Measurements,
              unmeasurable: dict[str, str] | None = None) -> list[ClaimVerdict]:
    """`unmeasurable` maps a metric prefix (throughput.<workload>) to why none of its figures was measured."""
    return [judge(claim, measurements, unmeasurable) for claim in claims]
