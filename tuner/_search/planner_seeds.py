"""What the planner gives a tuning session: seeds for the study, and a predictor for skipping.

The planner only steers the search (seeds, skipping candidates predicted far over budget); a
session without it still measures every trial, so a planner that cannot be built is a note in
`PlannerSeeds`, not an error.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_recompute.errors import RecomputeError
from lightning_recompute.planner.solver import BudgetError, PlannedPolicy, Planner, Prediction
from lightning_recompute.policy import RecomputePolicy
from tuner._search import Predictor, SearchSpace, Seed

if TYPE_CHECKING:
    from lightning_recompute.planner.sharding import Sharding
    from lightning_recompute.profile import Profile
    from tuner.recipe import Recipe

__all__ = [
    "PLANNER_FRONT_SEEDS",
    "PROFILE_REPEATS",
    "PlannerSeeds",
    "front_points",
    "kind_picks",
    "plan_seeds",
    "planned_from",
    "planner_seeds",
]

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

    def predictor(self) -> Predictor | None:
        """``(policy, micro_batch) -> Prediction``, or ``None`` without a planner."""
        if self.planner is None:
            return None
        planner = self.planner

        def predict(policy: RecomputePolicy, micro_batch: int | None) -> Prediction | None:
            try:
                return planner.predict(policy, micro_batch=micro_batch)
            except RecomputeError as err:
                _log.info("no prediction for %s: %s", policy.fingerprint(), err)
                return None

        return predict


def planner_seeds(
    planner: Planner, space: SearchSpace, budget_bytes: int, modes: Sequence[str]
) -> tuple[list[Seed], list[str]]:
    """The planner's pick at the budget (per micro-batch size), each kind of recomputation's own pick
    (`kind_picks`), and a few points of its front under the budget, each policy once.

    Only the pick gets a compiled twin (where compile is searched): the planner predicts eager steps,
    so the other seeds would double the trials on guesses of the same quality.
    """
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
            # The planner predicts eager steps only (compiling every mode's blocks to profile them
            # would cost a compilation each); compile is measured by trials, starting here.
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
    front = [p for p in planner.pareto_front(list(modes), micro_batch=micro_batch) if p.peak_bytes <= budget_bytes]
    front = [p for p in front if dict(p.modes) not in taken]
    if not front:
        return []
    count = min(PLANNER_FRONT_SEEDS, len(front))
    return [front[i] for i in sorted({round(i * (len(front) - 1) / max(1, count - 1)) for i in range(count)})]


def kind_picks(
    planner: Planner, budget_bytes: int, modes: Sequence[str], micro_batch: int | None
) -> list[tuple[str, PlannedPolicy]]:
    """For each kind of recomputation in ``modes``, the planner's pick at the budget using that kind alone
    (with ``none`` on the other layers): ``[(kind, pick)]``, kinds with no fitting policy left out.

    A kind is each mode of ``modes`` but ``none``: ``offload`` and each ``selective:<family>`` too, so a
    recipe searching them all gets up to one seed per mode and micro-batch size, labelled
    ``planner:<mode>-only`` (``planner:selective:attn-only@mb8``).

    Why each is seeded, not only the fastest prediction: the planner ranks kinds (``full`` against
    ``selective``) by `PROFILE_REPEATS` timed steps each, and those move with the machine. On
    ``bench/decision_quality.py``'s ``gpt4`` the profile's pick was a selective policy (``ss..``, once
    ``ssss``) rather than ``FF..`` (the fastest) in 8 and 5 of 30 profiles in two runs of
    `bench/seed_coverage.py`; then no seed measured ``FF..``, and in 3 of 10 tuning sessions no trial did.
    Within one kind the ranking is steadier (which layers, not how each is recomputed). No threshold on the
    predicted gap can tell which kinds are worth a trial: beside a busy neighbour a profile put ``FF..`` 45%
    behind ``ss..`` (the first run, committed in 7f4f3b1). Each kind costs at most one trial.

    Empty when ``none`` is not searched: a kind alone is then a uniform policy, which the baselines
    already measure.
    """
    if "none" not in modes:
        return []
    out = []
    for kind in modes:
        if kind == "none":
            continue
        try:
            out.append((kind, planner.solve(budget_bytes, modes=["none", kind], micro_batch=micro_batch)))
        except BudgetError:
            continue  # this kind alone does not fit the budget at this micro-batch
    return out


def plan_seeds(
    recipe: Recipe, space: SearchSpace, budget_bytes: int, stored: dict[str, Any] | None = None
) -> PlannerSeeds:
    """Profile the recipe's model (or reuse ``stored``, the study's profile) and build the planner's seeds.

    The profile is one device's, measured whole: a mode that does not fit with every layer in it is
    profiled a group of layers at a time (`lightning_recompute.profile.Profile.split`). For a multi-rank recipe the
    planner plans one rank of it (`lightning_recompute.planner.sharding`); the study stores the measured profile.
    The note says which profile the planner planned from.

    Never raises for the planner's own failure (only for Ctrl-C): the note says why there are no
    predictions, and the session seeds from the baselines only.
    """
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
    except KeyboardInterrupt:
        raise
    except Exception as err:  # noqa: BLE001 - the search works without predictions; say why there are none
        _log.debug("planning failed", exc_info=True)
        return PlannerSeeds(note=f"planner failed ({type(err).__name__}: {err}); seeding from baselines only")
    notes.insert(0, planned_from(measured, sharding))
    if recipe.trainer.precision.endswith("-mixed"):
        notes.append(
            f"planner: profiled without autocast; {recipe.trainer.precision} trials may differ from predictions"
        )
    return PlannerSeeds(planner=planner, profile=measured, seeds=seeds, note="; ".join(notes))


def planned_from(profile: Profile, sharding: Sharding | None) -> str:
    """Which profile the planner planned from, in words."""
    words = f"planner: planned from a profile of one {profile.device} device at micro-batch {profile.micro_batch}"
    for mode, steps in profile.split.items():
        words += f" ({mode} did not fit with every layer in it: profiled in {steps} steps, a group of layers each)"
    if sharding is not None:
        words += f", for one rank of {sharding.world_size} ({sharding.strategy})"
    return words
