"""Pure statistics of the fleet report: distributions, robust z-scores, the fleet's most common values."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import TypeVar

from b70ctl.fleet.model import Distribution

# Iglewicz & Hoaglin: |modified z| > 3.5 marks an outlier; 0.6745 makes MAD comparable to a normal's sigma.
OUTLIER_THRESHOLD = 3.5
MAD_TO_SIGMA = 0.6745
# When more than half the values are equal, MAD is 0; the mean absolute deviation (scaled to sigma) stands in.
MEAN_AD_TO_SIGMA = 0.7979

T = TypeVar("T", bound=Hashable)


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def quantile(ordered: Sequence[float], fraction: float) -> float:
    """Linear interpolation between order statistics (numpy's default) of an already sorted sequence."""
    position = (len(ordered) - 1) * fraction
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def distribution(values: Sequence[float]) -> Distribution | None:
    if not values:
        return None
    ordered = sorted(values)
    center = quantile(ordered, 0.5)
    return Distribution(
        n=len(ordered),
        median=center,
        mad=median([abs(v - center) for v in ordered]),
        min=ordered[0],
        max=ordered[-1],
        p10=quantile(ordered, 0.1),
        p90=quantile(ordered, 0.9),
    )


def robust_z_scores(values: Sequence[float]) -> list[float] | None:
    """Modified z-score of each value: MAD_TO_SIGMA * (x - median) / MAD. None when the values have no spread
    at all (every value equal) or there are fewer than 3: nothing can stand out then."""
    if len(values) < 3:
        return None
    center = median(values)
    deviations = [abs(v - center) for v in values]
    mad = median(deviations)
    if mad > 0:
        return [MAD_TO_SIGMA * (v - center) / mad for v in values]
    mean_deviation = sum(deviations) / len(deviations)
    if mean_deviation == 0:
        return None
    return [MEAN_AD_TO_SIGMA * (v - center) / mean_deviation for v in values]


def plurality(counts: Counter[T]) -> T | None:
    """The most common value when it is strictly more common than every other one (the fleet's "majority" even
    below 50%); None on a tie, where no value can be called the norm."""
    ranked = counts.most_common(2)
    if not ranked:
        return None
    if len(ranked) == 2 and ranked[0][1] == ranked[1][1]:
        return None
    return ranked[0][0]
