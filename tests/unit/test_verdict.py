"""Claims against measurements: the bound, the tolerance in the measurement's favour, and not-measured."""

from __future__ import annotations

import pytest

from b70ctl.recipes.model import Claim, Tolerance
from b70ctl.report.verdict import judge


def claim(**fields) -> Claim:
    return Claim(id="c", description="d", metric="m", source="s", **fields)


@pytest.mark.parametrize(
    ("fields", "measured", "verdict"),
    [
        ({"op": ">=", "value": 72.2}, 72.2, "met"),
        ({"op": ">=", "value": 72.2}, 72.1, "not_met"),
        ({"op": ">=", "value": 72.2, "tolerance": Tolerance(relative=0.10)}, 64.98, "met"),
        ({"op": ">=", "value": 72.2, "tolerance": Tolerance(relative=0.10)}, 64.97, "not_met"),
        ({"op": "<=", "value": 1.0, "tolerance": Tolerance(absolute=0.5)}, 1.5, "met"),
        ({"op": "<=", "value": 1.0, "tolerance": Tolerance(absolute=0.5)}, 1.51, "not_met"),
        ({"op": "between", "low": 38.0, "high": 53.0}, 40.98, "met"),
        ({"op": "between", "low": 38.0, "high": 53.0}, 37.9, "not_met"),
        ({"op": "between", "low": 38.0, "high": 53.0, "tolerance": Tolerance(relative=0.1)}, 58.2, "met"),
        ({"op": "between", "low": 38.0, "high": 53.0, "tolerance": Tolerance(relative=0.1)}, 58.4, "not_met"),
    ],
)
def test_scalar_claims(fields, measured, verdict):
    assert judge(claim(**fields), {"m": measured}).verdict == verdict


def test_per_position_names_the_first_position_off():
    published = [0.76, 0.45, 0.31, 0.14, 0.10, 0.02, 0.00]
    c = claim(op="per_position", values=published, tolerance=Tolerance(absolute=0.08))
    assert judge(c, {"m": [0.80, 0.40, 0.30, 0.10, 0.12, 0.0, 0.0]}).verdict == "met"
    off = judge(c, {"m": [0.80, 0.30, 0.30, 0.10, 0.12, 0.0, 0.0]})
    assert off.verdict == "not_met" and off.reason.startswith("position 1: 0.300 vs 0.45")
    short = judge(c, {"m": [0.8, 0.4]})
    assert short.verdict == "not_met" and "measured 2 positions" in short.reason


def test_missing_measurement_is_not_measured_not_failed():
    result = judge(claim(op=">=", value=1.0), {})
    assert result.verdict == "not_measured" and "no measurement m" in result.reason


def test_bound_text_shows_the_tolerance():
    assert claim(op=">=", value=72.2, tolerance=Tolerance(relative=0.1)).describe_bound() == ">= 72.2 (tolerance 10%)"
    assert claim(op="between", low=38, high=53).describe_bound() == "38 .. 53"
    # Both tolerances: Tolerance.slack applies the larger, and the text names both rather than hiding one.
    both = claim(op="<=", value=1.0, tolerance=Tolerance(relative=0.1, absolute=0.5))
    assert both.describe_bound() == "<= 1 (tolerance 10% or ±0.5, the larger)"
    assert both.tolerance.slack(1.0) == 0.5
