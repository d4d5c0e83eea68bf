"""The capped CPU device (``RECOMPUTE_CPU_MEMORY_LIMIT``) for tests: a cap between two policies' peaks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_recompute import RecomputeCallback, RecomputePolicy
from tuner.recipe import Recipe


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


def planned_cap(recipe: Recipe) -> int:
    """Midway between the planner's predicted peaks of full and none for one rank of ``recipe``, from a profile
    of its model on this (uncapped) CPU, sharded for the recipe's ranks."""
    from lightning_recompute.planner import Planner
    from lightning_recompute.planner.sharding import shard_profile, sharding_for
    from tuner.recipe._profile import profile_recipe_here, recipe_layout

    profile = profile_recipe_here(recipe, None, 1)
    sharding = sharding_for(recipe)
    if sharding is not None:
        profile = shard_profile(profile, recipe_layout(recipe, profile.layer_names), sharding)
    planner = Planner(profile)
    none, full = (planner.predict(RecomputePolicy.uniform(m)).peak_bytes for m in ("none", "full"))
    return (none + full) // 2
