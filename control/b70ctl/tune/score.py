"""The tune's score of a candidate: a robust lower bound of its per-request decode rate.

median - 1.4826 * MAD (the MAD scaled to a normal sigma): a setting that is fast once and slow often has a wide
MAD and loses to one that is steadily a little slower. Pure functions over the rates, so tests give exact inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

from b70ctl.report.stats import SIGMA_PER_MAD, mad, median


def robust_score(rates_tok_s: Sequence[float]) -> float | None:
    """median - 1.4826 * MAD of the rates; None without any rate."""
    if not rates_tok_s:
        return None
    return median(rates_tok_s) - SIGMA_PER_MAD * mad(rates_tok_s)
