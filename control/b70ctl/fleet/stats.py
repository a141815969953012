"""Pure statistics of the fleet report: distributions, robust z-scores, the fleet's most common values."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from typing import TypeVar

from b70ctl.fleet.model import Distribution
from b70ctl.report.stats import SIGMA_PER_MAD, mad, median, percentile

# Iglewicz & Hoaglin: |modified z| > 3.5 marks an outlier, z = (x - median) / (MAD x SIGMA_PER_MAD).
OUTLIER_THRESHOLD = 3.5
# When more than half the values are equal, MAD is 0; the mean absolute deviation (scaled to sigma) stands in.
MEAN_AD_TO_SIGMA = 0.7979
# The spread never counts as less than 1% of the median: with few hosts, or hosts that agree to 0.1%, MAD alone
# would call a 1% difference an outlier. With this floor a host within ~5% of the fleet median never is one.
MIN_SPREAD_FRACTION = 0.01

T = TypeVar("T", bound=Hashable)


def distribution(values: Sequence[float]) -> Distribution | None:
    if not values:
        return None
    return Distribution(n=len(values), median=median(values), mad=mad(values), min=min(values), max=max(values),
                        p10=percentile(values, 10), p90=percentile(values, 90))


def robust_z_scores(values: Sequence[float]) -> list[float] | None:
    """Modified z-score of each value: (x - median) / sigma, sigma = MAD x SIGMA_PER_MAD (or the scaled mean absolute
    deviation when MAD is 0), never below MIN_SPREAD_FRACTION x |median|. None when there are fewer than 3
    values, or all are 0: nothing can stand out then."""
    if len(values) < 3:
        return None
    center = median(values)
    deviations = [abs(v - center) for v in values]
    spread = mad(values)
    sigma = spread * SIGMA_PER_MAD if spread > 0 else sum(deviations) / len(deviations) / MEAN_AD_TO_SIGMA
    sigma = max(sigma, MIN_SPREAD_FRACTION * abs(center))
    if sigma == 0:
        return None
    return [(v - center) / sigma for v in values]


def plurality(counts: Counter[T]) -> T | None:
    """The most common value when it is strictly more common than every other one (the fleet's "majority" even
    below 50%); None on a tie, where no value can be called the norm."""
    ranked = counts.most_common(2)
    if not ranked:
        return None
    if len(ranked) == 2 and ranked[0][1] == ranked[1][1]:
        return None
    return ranked[0][0]
