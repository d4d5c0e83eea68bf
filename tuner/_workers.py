"""Workers sharing one study (docs/CLUSTER.md): heartbeats, dead workers' trials, no surplus or doubled trials,
the wait for others' trials before the gate."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tuner._search.attrs import StudyAttr, TrialAttr

if TYPE_CHECKING:
    from tuner._search import Proposal, TuningStudy
    from tuner._tracking import Tracker

Say = Callable[[str], None]


class Presence:
    """What this worker's heartbeats keep alive; `beat_study` and `beat_tracker` run on separate threads so
    that a slow tracking server never stalls the study's beat, by which other workers judge this one alive."""

    def __init__(self) -> None:
        self.study: TuningStudy | None = None
        self.tracker: Tracker | None = None
        self.setting_up = False
        self.in_flight: Proposal | None = None  # asked, not yet told

    def beat_study(self) -> None:
        proposal = self.in_flight
        if self.study is not None and self.setting_up:
            self.study.study.set_user_attr(StudyAttr.SETUP_HEARTBEAT, time.time())
        if proposal is not None:
            with contextlib.suppress(Exception):  # told meanwhile: a finished trial takes no heartbeat
                proposal.trial.set_user_attr(TrialAttr.HEARTBEAT, time.time())

    def beat_tracker(self) -> None:
        if self.tracker is not None:
            self.tracker.sessions.beat()


def reap(study: TuningStudy, tracker: Tracker, grace_s: float, note: Say) -> None:
    """Fail the trials of dead workers (their candidates go back in the queue) and record them in MLflow."""
    abandoned = study.reap_dead(grace_s)
    for trial, why in abandoned:
        policy, micro_batch = study.space.decode(trial.params)
        tracker.sessions.log_abandoned_trial(
            trial.number,
            policy,
            study.space.layer_names,
            micro_batch,
            reason=why,
            session_run_id=trial.user_attrs.get(TrialAttr.SESSION_RUN),
        )
        note(f"trial {trial.number} failed: {why}; its candidate is queued again")
    if abandoned:
        end_dead_session_runs(tracker, study.study.study_name, grace_s, note)


def end_dead_session_runs(tracker: Tracker, study_name: str, grace_s: float, note: Say) -> None:
    for run_id in tracker.sessions.end_dead_sessions(study_name, grace_s):
        note(f"session run {run_id} of a dead worker ended KILLED")


def _taken(study: TuningStudy, grace_s: float) -> int:
    return study.ran_count() + study.running_alive(grace_s)


def others_fill(study: TuningStudy, n_trials: int, grace_s: float) -> bool:
    return _taken(study, grace_s) >= n_trials


def slot_taken(study: TuningStudy, n_trials: int, grace_s: float) -> bool:
    """Whether this worker's asked trial is one past ``n_trials``. Every worker asks (its trial turns RUNNING)
    before it counts, so of two asking at once the later sees the earlier: trial numbers cannot decide, as an
    enqueued seed keeps the number it got when enqueued."""
    return _taken(study, grace_s) > n_trials


def stand_down_reason(study: TuningStudy, proposal: Proposal, n_trials: int, grace_s: float) -> str | None:
    """Why this worker must not run ``proposal``: past ``n_trials``, or another worker asked the same candidate
    at the same moment and has not claimed it (neither can know the other measures it, so both stand down)."""
    if slot_taken(study, n_trials, grace_s):
        return "not run: other workers' trials make up n_trials"
    if proposal.duplicate_of is None and proposal.contended_by is not None:
        return (
            f"not run: trial {proposal.contended_by.number} of another worker, asked at the same moment, "
            "has the same policy and micro-batch"
        )
    return None


def wait_for_running(study: TuningStudy, timeout_s: float, stop: threading.Event, notify: Say, note: Say) -> None:
    """Wait until no trial runs, so every worker gates the same winner (a dead worker's stays RUNNING: a timeout)."""
    deadline = time.monotonic() + timeout_s
    if running := len(study.running()):
        notify(f"gate: waiting for {running} trial(s) of other workers to finish ...")
    while running and time.monotonic() < deadline:
        if stop.wait(1.0):
            return
        running = len(study.running())
    if running:
        note(f"{running} trial(s) of other workers still running after the wait; gating the best so far")
