"""Seeds: candidates enqueued before sampling starts (the baselines; the planner adds its own)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from lightning_recompute.policy import RecomputePolicy
from tuner._search.space import SearchSpace


class Source(str, enum.Enum):
    """Where a trial's policy came from. A trial's label (``baseline:full``, ``planner:front2``, stored as
    the trial's ``seed`` attribute since the first studies) says it; `of` reads it, in this one place."""

    BASELINE = "baseline"
    PLANNER = "planner"
    SEARCH = "search"
    """Sampled by Optuna's sampler (no label)."""

    @classmethod
    def of(cls, label: str | None) -> Source:
        kind = (label or "").partition(":")[0]
        return cls(kind) if kind in (cls.BASELINE.value, cls.PLANNER.value) else cls.SEARCH


def pick_of(label: str | None) -> str:
    """What a label names within its source: ``full`` of ``baseline:full``, ``budget`` of ``planner:budget``."""
    return (label or "").partition(":")[2]


@dataclass(frozen=True)
class Seed:
    """A candidate enqueued before sampling starts: a baseline or a planner suggestion."""

    name: str
    """``baseline:full``, ``planner:budget`` ...: how the table and MLflow label it."""
    modes: Mapping[str, str]
    """Per-layer modes."""
    micro_batch: int | None = None
    """Micro-batch size (``None``: the first searched, or the data module's own)."""
    compile: bool | None = None
    """Whether the layers are compiled (``None``: the first choice of ``search.compile``)."""


BASELINES = ("none", "full", "selective", "every_2nd_full")
"""The baselines every study measures (those whose modes the recipe searches)."""


def baseline_seeds(space: SearchSpace) -> list[Seed]:
    """No recompute, full on every layer, selective on every layer, full on every 2nd layer.

    A baseline whose mode the recipe does not search is left out: it could not be compared at
    the same settings.
    """
    names = space.layer_names
    mb = space.micro_batches[0] if space.micro_batches else None
    seeds = []
    for mode in ("none", "full", "selective"):
        if mode in space.modes:
            seeds.append(Seed(f"baseline:{mode}", {n: mode for n in names}, mb))
    if "full" in space.modes and "none" in space.modes and len(names) > 1:
        every = RecomputePolicy.every_kth(names, 2, "full").resolve(names)
        seeds.append(Seed("baseline:every_2nd_full", {n: m.value for n, m in every.items()}, mb))
    return seeds
