"""What the planner gives a tuning session: seeds for the study, and a predictor for skipping. It only steers
the search, so a planner that cannot be built is a note in `PlannerSeeds`, not an error."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_recompute.errors import RecomputeError
from lightning_recompute.planner.solver import BudgetError, PlannedPolicy, Planner, Prediction
from lightning_recompute.policy import RecomputePolicy
from tuner._search import SearchSpace, Seed

if TYPE_CHECKING:
    from lightning_recompute.profile import Profile
    from tuner.recipe import Recipe

_log = logging.getLogger(__name__)

PROFILE_REPEATS = 2
"""Timed profiling steps per mode: the planner's times only order the seeds; trials measure for real."""

PLANNER_FRONT_SEEDS = 3
"""How many points of the planner's predicted Pareto front (besides its pick at the budget) are seeded."""


@dataclass
class PlannerSeeds:
    """The planner's contribution to a tuning session, or why there is none."""

    planner: Planner | None = None
    profile: Profile | None = None
    seeds: list[Seed] = field(default_factory=list)
    note: str | None = None

    def predict(self, policy: RecomputePolicy, micro_batch: int | None) -> Prediction | None:
        """The planner's view of a candidate, if it has one."""
        if self.planner is None:
            return None
        try:
            return self.planner.predict(policy, micro_batch=micro_batch)
        except RecomputeError as err:
            _log.info("no prediction for %s: %s", policy.fingerprint(), err)
            return None


def planner_seeds(
    planner: Planner, space: SearchSpace, budget_bytes: int, modes: Sequence[str]
) -> tuple[list[Seed], list[str]]:
    """The planner's pick at the budget per micro-batch size, each kind's pick, and a few points of its front.
    Only the pick gets a compiled twin: the planner predicts eager steps, so more twins would be guesses."""
    seeds: list[Seed] = []
    notes: list[str] = []
    sizes: list[int | None] = list(space.micro_batches) if space.micro_batches else [None]
    for mb in sizes:
        at = "" if mb is None or len(sizes) == 1 else f"@mb{mb}"
        try:
            pick = planner.solve(budget_bytes, modes=list(modes), micro_batch=mb)
        except BudgetError as err:
            notes.append(f"planner: nothing fits at micro-batch {mb if mb is not None else 'default'}: {err}")
            continue
        seeds.append(Seed(f"planner:budget{at}", dict(pick.modes), mb))
        if space.compile_searched:
            seeds.append(Seed(f"planner:budget{at}+compile", dict(pick.modes), mb, compile=True))
        taken = [dict(pick.modes)]
        for kind, only in kind_picks(planner, budget_bytes, modes, mb):
            if dict(only.modes) not in taken:
                seeds.append(Seed(f"planner:{kind}-only{at}", dict(only.modes), mb))
                taken.append(dict(only.modes))
        points = front_points(planner, budget_bytes, modes, mb, taken)
        seeds += [Seed(f"planner:front{j + 1}{at}", dict(p.modes), mb) for j, p in enumerate(points)]
    return seeds, notes


def front_points(
    planner: Planner,
    budget_bytes: int,
    modes: Sequence[str],
    micro_batch: int | None,
    taken: Sequence[Mapping[str, str]],
) -> list[PlannedPolicy]:
    """Up to `PLANNER_FRONT_SEEDS` fitting points of the planner's front, evenly over it, none of ``taken``
    (per-layer modes already seeded): alternatives the prediction error could reorder."""
    front = planner.pareto_front(list(modes), micro_batch=micro_batch)
    front = [p for p in front if p.peak_bytes <= budget_bytes and dict(p.modes) not in taken]
    if not front:
        return []
    count = min(PLANNER_FRONT_SEEDS, len(front))
    return [front[i] for i in sorted({round(i * (len(front) - 1) / max(1, count - 1)) for i in range(count)})]


def kind_picks(
    planner: Planner, budget_bytes: int, modes: Sequence[str], micro_batch: int | None
) -> list[tuple[str, PlannedPolicy]]:
    """The pick using each mode alone (``none`` elsewhere; without ``none`` the baselines are those): each kind,
    since the planner ranks kinds by `PROFILE_REPEATS` steps, which move with the machine (bench/seed_coverage.py)."""
    out = []
    for kind in modes if "none" in modes else ():
        if kind != "none":
            with contextlib.suppress(BudgetError):  # this kind alone does not fit the budget at this micro-batch
                out.append((kind, planner.solve(budget_bytes, modes=["none", kind], micro_batch=micro_batch)))
    return out


def plan_seeds(
    recipe: Recipe, space: SearchSpace, budget_bytes: int, stored: dict[str, Any] | None = None
) -> PlannerSeeds:
    """Profile the model (or reuse ``stored``) and plan one rank; the planner failing is a note, not an error."""
    from lightning_recompute.planner.sharding import shard_profile, sharding_for
    from lightning_recompute.profile import Profile
    from tuner._trials import profile_recipe
    from tuner.recipe._profile import recipe_layout

    try:
        mb = space.micro_batches[0] if space.micro_batches else None
        measured = (
            Profile.from_dict(stored) if stored is not None else profile_recipe(recipe, mb, repeats=PROFILE_REPEATS)
        )
        sharding = sharding_for(recipe)
        profile = (
            measured
            if sharding is None
            else shard_profile(measured, recipe_layout(recipe, measured.layer_names), sharding)
        )
        planner = Planner(profile)
        seeds, notes = planner_seeds(planner, space, budget_bytes, recipe.search.modes)
    except Exception as err:  # noqa: BLE001 - the search works without predictions; say why there are none
        _log.debug("planning failed", exc_info=True)
        return PlannerSeeds(note=f"planner failed ({type(err).__name__}: {err}); seeding from baselines only")
    words = f"planner: planned from a profile of one {measured.device} device at micro-batch {measured.micro_batch}"
    for mode, steps in measured.split.items():
        words += f" ({mode} did not fit with every layer in it: profiled in {steps} steps, a group of layers each)"
    if sharding is not None:
        words += f", for one rank of {sharding.world_size} ({sharding.strategy})"
    notes.insert(0, words)
    if recipe.trainer.precision.endswith("-mixed"):
        notes.append(
            f"planner: profiled without autocast; {recipe.trainer.precision} trials may differ from predictions"
        )
    return PlannerSeeds(planner=planner, profile=measured, seeds=seeds, note="; ".join(notes))
