"""Seeds: candidates enqueued before sampling starts (the baselines; the planner adds its own)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from lightning_recompute.policy import RecomputePolicy
from tuner._search.space import SearchSpace


class Source(str, enum.Enum):
    """Where a trial's policy came from, as its label (``baseline:full``, ``planner:front2``; the trial's
    ``seed`` attribute) says; `of` reads it, in this one place."""

    BASELINE = "baseline"
    PLANNER = "planner"
    SEARCH = "search"  # sampled (no label)

    @classmethod
    def of(cls, label: str | None) -> Source:
        kind = (label or "").partition(":")[0]
        return cls(kind) if kind in (cls.BASELINE.value, cls.PLANNER.value) else cls.SEARCH


def pick_of(label: str | None) -> str:
    """What a label names within its source: ``full`` of ``baseline:full``, ``budget`` of ``planner:budget``."""
    return (label or "").partition(":")[2]


@dataclass(frozen=True)
class Seed:
    name: str  # baseline:full, planner:budget ...: how the table and MLflow label it
    modes: Mapping[str, str]
    micro_batch: int | None = None  # None: the first searched, or the data module's own
    compile: bool | None = None  # None: the first choice of search.compile


def baseline_seeds(space: SearchSpace) -> list[Seed]:
    """No recompute, full, selective, full on every 2nd layer: those whose modes the recipe searches."""
    names = space.layer_names
    mb = space.micro_batches[0] if space.micro_batches else None
    seeds = [
        Seed(f"baseline:{m}", dict.fromkeys(names, m), mb) for m in ("none", "full", "selective") if m in space.modes
    ]
    if "full" in space.modes and "none" in space.modes and len(names) > 1:
        every = RecomputePolicy.every_kth(names, 2, "full").resolve(names)
        seeds.append(Seed("baseline:every_2nd_full", {n: m.value for n, m in every.items()}, mb))
    return seeds
