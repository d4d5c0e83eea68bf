"""The session's MLflow run, opened and closed, and the policy file reconciled with what MLflow records.

Opening ends what dead sessions left (their session runs, stale trial folders, half-written files)
and starts or resumes this session's run: one study, one session run. Whatever the session ended as
(a decision, nothing feasible, interrupted), MLflow alone must explain it: the session run gets the
notes the session took without a trial (the space, planner trouble, why it stopped), the trials
table, the baselines and the best trial. The policy file is compared with the good policy MLflow
records and restored from it when it does not hold it (deleted, edited, or written by a session
that crashed before recording).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tuner.tracking import open_tracker
from tuner.workers import end_dead_session_runs

if TYPE_CHECKING:
    from tuner.recipe import Recipe
    from tuner.summary import SessionSummary
    from tuner.tracking import Tracker

Say = Callable[[str], None]

__all__ = ["close_session_run", "open_session_run", "reconcile_policy_file"]


def open_session_run(recipe: Recipe, study: str, grace_s: float, notify: Say, note: Say) -> tuple[Tracker, str]:
    """The tracker and this session's run (resumed when an interrupted or dead session of ``study`` left one)."""
    from tuner.trials import clean_stale_trial_dirs

    tracker = open_tracker(recipe.tracking.uri, str(recipe.tracking.experiment))
    # A session SIGKILLed earlier left its session run RUNNING: end it KILLED first, so this
    # session resumes it (one study, one session run) instead of opening another.
    end_dead_session_runs(tracker, study, grace_s, note)
    for done in tracker.clean_leftovers(recipe.output, grace_s):
        note(done)
    run_id = tracker.start_session(recipe, study_name=study, resume=True)
    for folder in clean_stale_trial_dirs():
        notify(f"removed {folder}: its tuning process is gone")
    return tracker, run_id


def reconcile_policy_file(tracker: Tracker, output: Path, summary: SessionSummary, note: Say) -> None:
    """Make ``output`` hold the good policy (restored from MLflow when it does not, and said so), and
    point ``summary`` at it when there is a good policy."""
    restored = tracker.restore_file(output)
    if restored is not None:
        note(f"policy file: {restored}")
    if summary.policy_path is None and tracker.current_good() is not None:
        summary.policy_path = output


def close_session_run(tracker: Tracker, summary: SessionSummary, status: str, *, study: str, budget_bytes: int) -> None:
    """End the session run ``status`` (FINISHED, KILLED) with the session's notes, trials table and baselines."""
    notes = [
        f"study {study} ({summary.storage})",
        f"search space {summary.search_space}",
        f"status {summary.status}",
        *summary.notes,
    ]
    tracker.note_session(notes)
    tracker.finish_session(
        status=status,
        best=None if summary.best is None else summary.best.to_dict(),
        trials_table=[r.to_dict() for r in summary.records],
        baselines={k: v.to_dict() for k, v in summary.baselines.items()},
        budget_bytes=budget_bytes,
    )
