"""Workers sharing one study (docs/CLUSTER.md): heartbeats (`Presence`), who sets the study up
(`join_setup`), dead workers' trials (`reap`), no surplus or doubled trials (`stand_down_reason`), and the
wait for others' trials before the gate (`wait_for_running`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tuner._search import Proposal, TuningStudy
    from tuner._tracking import Tracker

SETUP_WAIT_S = 600.0
"""How long a worker joining a new study waits for the worker that created it to profile and seed it."""

Say = Callable[[str], None]


class Presence:
    """What this worker's heartbeats keep alive; `beat_study` and `beat_tracker` run on separate threads so
    that a slow tracking server never stalls the study's beat, by which other workers judge this one alive."""

    def __init__(self) -> None:
        self.study: TuningStudy | None = None
        self.tracker: Tracker | None = None
        self.setting_up = False  # this worker holds the study's setup
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
    """Whether this worker sets ``study`` up: it created it, or the worker that did died or gave up (waited for
    at most `SETUP_WAIT_S` until the study is seeded)."""
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
    """The study's measured trials and its live trials in flight (this worker's asked one among them)."""
    return study.ran_count() + study.in_flight.running_alive(grace_s)


def others_fill(study: TuningStudy, n_trials: int, grace_s: float) -> bool:
    """Whether the study's measured trials and the live trials in flight already make up ``n_trials``."""
    return _taken(study, grace_s) >= n_trials


def slot_taken(study: TuningStudy, n_trials: int, grace_s: float) -> bool:
    """Whether this worker's asked trial is one past ``n_trials``: then it stands down.

    Every worker asks (its trial turns RUNNING) before it counts, so of two asking at once the later
    sees the earlier; both may stand down, and a random pause (`tuner.session`) lets one go first next
    time. Trial numbers cannot decide: an enqueued seed keeps the number it got when enqueued.
    """
    return _taken(study, grace_s) > n_trials


def stand_down_reason(study: TuningStudy, proposal: Proposal, n_trials: int, grace_s: float) -> str | None:
    """Why this worker must not run ``proposal``, just asked, for another worker's trial; ``None``: run it.

    Past ``n_trials``, or another worker asked the same candidate at the same moment and has not claimed it
    yet: neither can know the other measures it, so both stand down.
    """
    if slot_taken(study, n_trials, grace_s):
        return "not run: other workers' trials make up n_trials"
    if proposal.duplicate_of is None and proposal.contended_by is not None:
        return (
            f"not run: trial {proposal.contended_by.number} of another worker, asked at the same moment, "
            "has the same policy and micro-batch"
        )
    return None


def wait_for_running(study: TuningStudy, timeout_s: float, stop: threading.Event, notify: Say, note: Say) -> None:
    """Wait until no trial of the study runs, so every worker gates the same final winner; at most
    ``timeout_s`` (a dead worker's trial stays RUNNING until it is recovered), or until ``stop`` is set."""
    deadline = time.monotonic() + timeout_s
    if running := len(study.in_flight.running()):
        notify(f"gate: waiting for {running} trial(s) of other workers to finish ...")
    while running and time.monotonic() < deadline:
        if stop.wait(1.0):
            return
        running = len(study.in_flight.running())
    if running:
        note(f"{running} trial(s) of other workers still running after the wait; gating the best so far")
