"""The statistics of a race: a sample's spread, and paired comparisons of candidates over rounds.

Why these and not a t-test on step times: steps share the machine's moment, so rounds are the unit; within
a round a spell of load slows every candidate, so candidates are compared by per-round ``log(time_b / time_a)``;
load comes in spells, so the median of those, with its distribution-free order-statistics interval (coverage at
least the confidence whatever the distribution, where a bootstrap's falls short on few rounds); and looking after
every round inflates false separations, so a race stops early only after `RacePlan.min_rounds` and at the
stricter `RacePlan.stop_confidence`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Interval", "Spread", "paired_ratio", "spread"]


@dataclass(frozen=True)
class Spread:
    """How noisy one sample of step times is."""

    n: int
    median: float
    mad_rel: float
    """Median absolute deviation over the median (0: every value equal)."""
    ci_rel: float
    """Relative width of the median's 95% interval; ``inf`` when the sample is too small for one."""


def spread(values: Sequence[float]) -> Spread:
    """The median of ``values`` (not empty) and its spread; with fewer than 6 values ``ci_rel`` is ``inf``."""
    if not values:
        raise ValueError("spread of an empty sample")
    xs = sorted(float(v) for v in values)
    n = len(xs)
    med = statistics.median(xs)
    mad = statistics.median(abs(x - med) for x in xs)
    lo, hi, coverage = _median_ranks(n)
    ci_rel = math.inf if coverage < 0.95 or med <= 0 else (xs[hi] - xs[lo]) / med
    return Spread(n=n, median=med, mad_rel=(mad / med) if med > 0 else 0.0, ci_rel=ci_rel)


def _median_ranks(n: int, confidence: float = 0.95) -> tuple[int, int, float]:
    """0-based ranks ``(j - 1, n - j)`` bracketing the median, and their coverage: ``j`` is the largest with
    ``1 - 2 P(Binomial(n, 1/2) <= j - 1) >= confidence``, else 1."""
    best, coverage = 1, 1.0 - 2.0 / 2.0**n
    below = 0.0  # P(Binomial(n, 1/2) <= j - 1)
    for j in range(1, n // 2 + 1):
        below += math.comb(n, j - 1) / 2.0**n
        if 1.0 - 2.0 * below < confidence:
            break
        best, coverage = j, 1.0 - 2.0 * below
    return best - 1, n - best, coverage


@dataclass(frozen=True)
class Interval:
    """A ratio of two candidates' step times with its interval: ``b / a`` (above 1: ``b`` is slower)."""

    ratio: float
    """The median over rounds of the per-round ratio."""
    low: float
    high: float
    rounds: int
    confidence: float
    """The interval's coverage: at least the confidence asked for, or less when too few rounds allow no more."""

    def stated(self, asked: float) -> float:
        """The level to print: ``asked`` when the interval covers at least that (its coverage moves in steps, and one
        level everywhere reads as one figure), else its own coverage."""
        return min(asked, self.confidence)

    def gain(self) -> tuple[float, float, float]:
        """``a``'s throughput over ``b``'s, less 1, with the interval: ``(gain, low, high)``."""
        return self.ratio - 1.0, self.low - 1.0, self.high - 1.0


def paired_ratio(a: Sequence[float], b: Sequence[float], *, confidence: float = 0.95) -> Interval:
    """The median ratio ``b / a`` of two candidates' per-round times (at least 2, positive), with its
    order-statistics interval."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} and {len(b)}")
    if len(a) < 2:
        raise ValueError(f"a paired ratio needs at least 2 rounds, got {len(a)}")
    if any(x <= 0 for x in (*a, *b)):
        raise ValueError("step times must be positive")
    logs = sorted(math.log(y / x) for x, y in zip(a, b, strict=True))
    lo, hi, coverage = _median_ranks(len(logs), confidence)
    return Interval(
        ratio=math.exp(statistics.median(logs)),
        low=math.exp(logs[lo]),
        high=math.exp(logs[hi]),
        rounds=len(logs),
        confidence=coverage,
    )
