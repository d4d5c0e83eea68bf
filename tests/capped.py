"""The capped CPU device (``RECOMPUTE_CPU_MEMORY_LIMIT``) for tests: a cap between two policies' peaks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_recompute import RecomputeCallback, RecomputePolicy


def measured_peak(fit: Callable[[list[Any]], Any], mode: str) -> int:
    """The highest peak `RecomputeCallback` measures in ``fit([callback])`` with every layer in ``mode``."""
    cb = RecomputeCallback(RecomputePolicy.uniform(mode))
    fit([cb])
    return max(r.peak_bytes or 0 for r in cb.records)


def cap_between(fit: Callable[[list[Any]], Any], above: str = "full", below: str = "none") -> int:
    """A cap that ``below``'s steps exceed and ``above``'s fit under (midway between their measured peaks)."""
    high, low = measured_peak(fit, below), measured_peak(fit, above)
    assert high > low, f"{below} peaks at {high} bytes, {above} at {low}: no cap separates them"
    return (high + low) // 2
