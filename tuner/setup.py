"""A study's setup, once for all its workers: profile the model, plan, store the profile and seed the study.

The worker that created the study (or took over from one that died) sets it up; every other worker,
and a session resuming the study, waits for that (`tuner.workers.join_setup`) and plans from the
profile stored in the study, so all predict with the same figures and skip the same candidates
without profiling again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tuner.killpoints import kill_point
from tuner.search import baseline_seeds
from tuner.search.planner_seeds import PlannerSeeds, plan_seeds
from tuner.workers import join_setup

if TYPE_CHECKING:
    from tuner.recipe import Recipe
    from tuner.search import SearchSpace, TuningStudy
    from tuner.workers import Presence

__all__ = ["set_up_study"]

Say = Callable[[str], None]


def set_up_study(
    study: TuningStudy,
    name: str,
    recipe: Recipe,
    space: SearchSpace,
    budget_bytes: int,
    *,
    use_planner: bool,
    presence: Presence,
    grace_s: float,
    notify: Say,
    note: Say,
) -> PlannerSeeds:
    """Set ``study`` up, or join it; the planner's predictions and notes either way.

    Args:
        study: the study, just opened; name: its name (for the messages).
        recipe, space, budget_bytes: what the planner plans for.
        use_planner: profile and plan (else the study is seeded with the baselines only).
        presence: the worker's heartbeat state; it holds the setup while this worker sets it up.
        grace_s: how long another host's worker may stay silent before it counts as dead.
        notify: progress (printed, not kept); note: a decision along the way (kept).

    Returns:
        The seeding: its predictor serves the whole session; its seeds are empty when the study was
        set up by another session (they are already in the study).
    """
    if not join_setup(study, name, grace_s, notify, note):
        stored = study.setup.profile()
        seeding = (
            plan_seeds(recipe, space, budget_bytes, stored=stored)
            if stored
            else PlannerSeeds(note=study.setup.planner_note() or "the study holds no profile; no predictions")
        )
        seeding.seeds = []  # the study was seeded by the session that set it up
        if seeding.note:
            note(seeding.note)
        notify(f"study {name} resumed: {study.ran_count()} trials run so far")
        return seeding
    presence.setting_up = True
    try:
        kill_point("profiling")  # a test hook; see tuner.killpoints
        if use_planner:
            notify("profiling the model and planning ...")
            seeding = plan_seeds(recipe, space, budget_bytes)
        else:
            seeding = PlannerSeeds(note="planner not used (asked not to plan); seeding from baselines only")
        if seeding.profile is not None:
            study.setup.store_profile(seeding.profile.to_dict())
        if seeding.note:
            study.setup.store_planner_note(seeding.note)
            note(seeding.note)
        enqueued = study.seed([*baseline_seeds(space), *seeding.seeds])
    except BaseException:
        study.setup.abandon()
        raise
    finally:
        presence.setting_up = False
    notify(f"study {name} created; seeded {', '.join(enqueued) or 'nothing'}")
    return seeding
