"""Workers sharing one study (docs/CLUSTER.md): heartbeats, who sets it up, dead workers' trials, no surplus or
doubled trials, the wait for others' trials before the gate."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tuner._search import Proposal, TuningStudy
    from tuner._tracking import Tracker

SETUP_WAIT_S = 600.0  # for the worker that created a new study to profile and seed it

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
        study, proposal = self.study, self.in_flight
        if study is not None and self.setting_up:
            study.setup.beat()
        if study is not None and proposal is not None:
            with contextlib.suppress(Exception):  # told meanwhile: a finished trial takes no heartbeat
                study.in_flight.beat(proposal)

    def beat_tracker(self) -> None:
        if self.tracker is not None:
            self.tracker.sessions.beat()


def join_setup(study: TuningStudy, name: str, grace_s: float, notify: Say, note: Say) -> bool:
    """Whether this worker sets ``study`` up: it created it, or the worker that did died or gave up."""
    if study.created:
        return True
    if not study.setup.seeded:
        notify(f"study {name} is being set up by another worker; waiting ...")
    if study.setup.wait_seeded(SETUP_WAIT_S, grace_s=grace_s):
        return False
    note(f"taking over the study's setup: {study.setup.owner_dead(grace_s) or 'the worker setting it up gave up'}")
    study.setup.own()
    return True


def reap(
    study: TuningStudy, tracker: Tracker, grace_s: float, layer_names: Sequence[str], study_name: str, note: Say
) -> None:
    """Fail the trials of dead workers (their candidates go back in the queue) and record them in MLflow."""
    abandoned = study.in_flight.reap_dead(grace_s)
    for dead in abandoned:
        tracker.sessions.log_abandoned_trial(
            dead.number,
            dead.policy,
            list(layer_names),
            dead.micro_batch,
            reason=dead.reason,
            session_run_id=dead.session_run_id,
        )
        note(f"trial {dead.number} failed: {dead.reason}; its candidate is queued again")
    if abandoned:
        end_dead_session_runs(tracker, study_name, grace_s, note)


def end_dead_session_runs(tracker: Tracker, study_name: str, grace_s: float, note: Say) -> None:
    for run_id in tracker.sessions.end_dead_sessions(study_name, grace_s):
        note(f"session run {run_id} of a dead worker ended KILLED")


def _taken(study: TuningStudy, grace_s: float) -> int:
    return study.ran_count() + study.in_flight.running_alive(grace_s)


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
    if running := len(study.in_flight.running()):
        notify(f"gate: waiting for {running} trial(s) of other workers to finish ...")
    while running and time.monotonic() < deadline:
        if stop.wait(1.0):
            return
        running = len(study.in_flight.running())
    if running:
        note(f"{running} trial(s) of other workers still running after the wait; gating the best so far")
