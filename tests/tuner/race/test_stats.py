"""`lightning_recompute.race.stats`: a sample's spread, and the paired ratio of two candidates over rounds."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from bench.neighbour import LoadModel
from lightning_recompute.race.stats import paired_ratio, spread


def test_spread_of_a_sample() -> None:
    s = spread([1.0, 1.2, 0.9, 1.1, 1.0, 0.8])
    assert s.n == 6 and s.median == 1.0
    assert s.mad_rel == pytest.approx(0.1)
    # n = 6: min and max bracket the median with 96.9% >= 95%.
    assert s.ci_rel == pytest.approx((1.2 - 0.8) / 1.0)
    assert math.isinf(spread([1.0, 2.0, 3.0, 4.0, 5.0]).ci_rel)  # no 95% interval from 5 values
    assert spread([2.0, 2.0, 2.0]).mad_rel == 0.0
    with pytest.raises(ValueError, match="empty"):
        spread([])


def test_a_constant_ratio_is_recovered_exactly() -> None:
    a = [1.0, 2.0, 1.5, 3.0]
    iv = paired_ratio(a, [1.1 * x for x in a])
    assert iv.ratio == pytest.approx(1.1) and iv.low == pytest.approx(1.1) and iv.high == pytest.approx(1.1)
    assert not iv.low <= 1.0 <= iv.high and iv.rounds == 4
    gain, low, high = iv.gain()
    assert gain == pytest.approx(0.1) and low == pytest.approx(0.1) and high == pytest.approx(0.1)


def _rounds(true_ratio: float, n: int, seed: int) -> tuple[list[float], list[float]]:
    """Two candidates' round times under spells of load that hit both (they ran seconds apart)
    plus 3% independent noise each: what an interleaved race on a shared machine sees."""
    rng = random.Random(seed)
    load = LoadModel(seed=seed, busy_s=3.0, idle_s=3.0, busy_slowdown=0.8)
    a, b = [], []
    for i in range(n):
        f = load.factor(i * 1.5)
        a.append(0.1 * f * rng.uniform(0.97, 1.03))
        b.append(0.1 * true_ratio * f * rng.uniform(0.97, 1.03))
    return a, b


def test_pairing_sees_through_spells_of_load_that_unpaired_medians_do_not() -> None:
    covered = 0
    for seed in range(20):
        a, b = _rounds(1.05, 14, seed)
        iv = paired_ratio(a, b)
        covered += iv.low <= 1.05 <= iv.high
        assert not iv.low <= 1.0 <= iv.high, (seed, iv)  # 5% apart is told apart through an 80% load
    assert covered >= 19  # the interval's coverage is at least 95% (98.7% at 14 rounds)
    # The load moves each side's own median by far more than the 5% between them.
    spread_a = max(_rounds(1.05, 14, s)[0][0] for s in range(20)) / min(_rounds(1.05, 14, s)[0][0] for s in range(20))
    assert spread_a > 1.5


def test_identical_candidates_come_out_tied() -> None:
    tied = sum(iv.low <= 1.0 <= iv.high for iv in (paired_ratio(*_rounds(1.0, 14, s)) for s in range(40)))
    assert tied >= 38  # an A/A test: at 95% confidence (98.7% exact coverage at 14 rounds) nearly all tie


def test_the_interval_is_order_statistics_of_the_log_ratios() -> None:
    a = [1.0] * 8
    b = [1.30, 1.01, 1.02, 1.03, 1.04, 1.05, 1.06, 0.90]
    iv = paired_ratio(a, b)
    # 8 rounds: the extremes give 99.2% >= 95%; the next ranks only 93.0%.
    assert (iv.low, iv.high) == pytest.approx((0.90, 1.30)) and iv.confidence == pytest.approx(1 - 2 / 256)
    assert iv.ratio == pytest.approx(math.exp(statistics.median(math.log(x) for x in b)))
    few = paired_ratio([1.0] * 4, [1.1, 1.2, 1.3, 1.4])
    assert few.confidence == pytest.approx(1 - 2 / 16) and few.low == pytest.approx(1.1)  # honest about 87.5%


def test_bad_samples_are_refused() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="at least 2 rounds"):
        paired_ratio([1.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        paired_ratio([1.0, 0.0], [1.0, 1.0])
