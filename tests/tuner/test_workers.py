"""`tuner._workers`: the ``n_trials`` slots of workers sharing one study (two `TuningStudy` on one storage)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner._search import LayerInfo, SearchSpace, TuningStudy, baseline_seeds
from tuner._workers import others_fill, slot_taken

GRACE_S = 60.0
SPACE = SearchSpace.for_layers([LayerInfo(f"blocks.{i}", "k") for i in range(2)], ("none", "full"))


def worker(tmp_path: Path) -> TuningStudy:
    """One worker's handle on the shared study (a journal file both open)."""
    return TuningStudy.open(name="s", storage=str(tmp_path / "optuna.log"), space=SPACE, budget_bytes=1 << 30)


def test_a_seed_asked_last_stands_down_for_a_trial_that_counted_itself_in_whatever_the_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, late = worker(tmp_path), worker(tmp_path)
    late.seed(baseline_seeds(SPACE)[:1])  # trial 0, waiting
    # `first` read the queue before the seed landed, so it asks a fresh trial numbered after it.
    monkeypatch.setattr(first.study, "_pop_waiting_trial_id", lambda: None)
    fresh = first.ask()
    assert not slot_taken(first, n_trials=1, grace_s=GRACE_S)  # it counts itself within n_trials: it measures
    seed = late.ask()
    assert seed.label is not None and seed.number < fresh.number
    # The rule this replaced (the lower number keeps the slot) ran the seed too: two trials for n_trials=1.
    assert slot_taken(late, n_trials=1, grace_s=GRACE_S)
    late.tell_interrupted(seed, "stood down")
    assert [t.user_attrs.get("seed") for t in late.waiting()] == [seed.label]  # the seed is queued again
    assert others_fill(late, n_trials=1, grace_s=GRACE_S)  # and the worker waits rather than asking again


def test_two_workers_that_see_each_other_both_stand_down_and_the_slot_stays_free(tmp_path: Path) -> None:
    a, b = worker(tmp_path), worker(tmp_path)
    pa, pb = a.ask(), b.ask()  # both asked before either counted: each sees the other
    assert slot_taken(a, n_trials=1, grace_s=GRACE_S) and slot_taken(b, n_trials=1, grace_s=GRACE_S)
    a.tell_interrupted(pa, "stood down")
    b.tell_interrupted(pb, "stood down")
    assert not others_fill(a, n_trials=1, grace_s=GRACE_S)  # nothing measured or running: the next ask may run
    a.ask()
    assert not slot_taken(a, n_trials=1, grace_s=GRACE_S)


def test_a_slot_within_n_trials_is_free_with_others_running(tmp_path: Path) -> None:
    a, b = worker(tmp_path), worker(tmp_path)
    a.ask()
    b.ask()
    assert not slot_taken(b, n_trials=2, grace_s=GRACE_S)
    assert others_fill(b, n_trials=2, grace_s=GRACE_S)


def test_a_tracking_server_that_hangs_does_not_stall_the_studys_heartbeat() -> None:
    """Other workers judge this one alive by its beat in the study; the session run's beat is an HTTP
    call to MLflow that may retry for minutes. Each beats on its own thread."""
    import threading
    import time
    from types import SimpleNamespace

    from tuner._liveness import Heartbeat
    from tuner._workers import Presence

    study_beats: list[float] = []
    released, tracker_entered = threading.Event(), threading.Event()

    def hung_tracker_beat() -> None:
        tracker_entered.set()
        released.wait(60.0)

    presence = Presence()
    beat = SimpleNamespace(set_user_attr=lambda *_: study_beats.append(time.monotonic()))
    presence.study = SimpleNamespace(study=beat)  # type: ignore[assignment]
    presence.tracker = SimpleNamespace(sessions=SimpleNamespace(beat=hung_tracker_beat))  # type: ignore[assignment]
    presence.setting_up = True
    beats = [
        Heartbeat(presence.beat_study, interval=0.01).start(),
        Heartbeat(presence.beat_tracker, interval=0.01).start(),
    ]
    try:
        assert tracker_entered.wait(30.0), "the tracker's heartbeat never ran"
        seen = len(study_beats)
        deadline = time.monotonic() + 30.0
        while len(study_beats) < seen + 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(study_beats) >= seen + 5, "the study's heartbeat stalled behind the tracker's"
    finally:
        released.set()
        for beat in beats:
            beat.stop()
