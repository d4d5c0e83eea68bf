"""The gate lease (`tuner._search.lease`): one evidence gate at a time per study, on real Optuna storages."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import optuna
import pytest

from lightning_recompute.policy import RecomputePolicy
from tuner import recipe as recipe_mod
from tuner._gate import Candidate, decide
from tuner._search import GateLeaseTimeout, gate_lease
from tuner._search.lease import lease_name
from tuner._stores import open_storage
from tuner._tracking import Tracker
from tuner._trials import NumericsResult, TrialResult

A = RecomputePolicy.uniform("full")


def _storage_url(tmp_path: Path, kind: str) -> str:
    return str(tmp_path / "study.log") if kind == "journal" else f"sqlite:///{tmp_path / 'study.db'}"


_OTHER_WAITS = threading.Event()
"""Set when a worker finds the lease held (`gate_lease`'s ``on_wait``)."""


def _slow_trial(recipe: Any, policy: RecomputePolicy, **kw: Any) -> TrialResult:
    # The holder gates until the other worker waits for the lease: both arrive together, whatever the load.
    assert _OTHER_WAITS.wait(60.0), "the second worker never waited for the lease"
    n = kw["measure_steps"]
    return TrialResult(
        outcome="ok",
        peak_bytes=10 * 2**20,
        step_time_s=0.01,
        throughput=100.0,
        throughput_unit="tokens/s",
        step_times_s=(0.01,) * n,
        device="cpu",
    )


def _equal(recipe: Any, policy: RecomputePolicy, **kw: Any) -> NumericsResult:
    return NumericsResult(True, 0.0, "fake: bitwise equal")


@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_two_workers_finishing_together_promote_exactly_once(tmp_path: Path, uri: str, kind: str) -> None:
    recipe = recipe_mod.from_dict(
        {
            "name": "lease",
            "budget": "128MiB",
            "trial": {"warmup_steps": 1, "measure_steps": 2, "timeout_s": 30},
            "tracking": {"uri": uri, "experiment": "lease"},
        },
        source=tmp_path / "recipe.yaml",
    )
    url = _storage_url(tmp_path, kind)
    Tracker(uri, "lease")  # the experiment exists before the workers start, as after a search
    start = threading.Barrier(2)
    _OTHER_WAITS.clear()
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            # Each worker has its own storage connection and tracker, as separate processes would.
            storage, tracker = open_storage(url), Tracker(uri, "lease")
            out = tmp_path / f"machine{i}" / "policy.yaml"
            start.wait(timeout=30)
            with gate_lease(storage, "study", wait_s=60, poll_s=0.05, on_wait=lambda _: _OTHER_WAITS.set()) as waited:
                d = decide(
                    tracker,
                    Candidate(A),
                    recipe=recipe,
                    budget_bytes=None,
                    output_path=out,
                    run_trial=_slow_trial,
                    check_numerics=_equal,
                )
            results[i] = (waited, d, tracker.registry.restore_file(out), out)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(results) == 2

    promoted = [r for r in results.values() if r[1].promoted]
    unchanged = [r for r in results.values() if r[1].unchanged]
    assert len(promoted) == 1 and len(unchanged) == 1
    assert unchanged[0][0] is True  # the no-op worker waited for the lease
    history = Tracker(uri, "lease").registry.history()
    assert [h.kind for h in history] == ["promote"]
    # Both machines' files hold the one promoted policy: the waiter restored its own from MLflow.
    assert all(RecomputePolicy.load(r[3]) == A for r in results.values())
    assert unchanged[0][2] is not None and "was missing" in unchanged[0][2]
    # Released: nothing but the study's own name is left in the storage.
    assert lease_name("study") not in optuna.get_all_study_names(open_storage(url))


def _hold(storage: optuna.storages.BaseStorage, host: str, pid: int) -> None:
    lease_id = storage.create_new_study([optuna.study.StudyDirection.MINIMIZE], lease_name("study"))
    storage.set_study_user_attr(lease_id, "host", host)
    storage.set_study_user_attr(lease_id, "pid", pid)
    storage.set_study_user_attr(lease_id, "since", "2026-01-01T00:00:00+00:00")


@pytest.mark.slow
def test_a_lease_whose_holder_died_on_this_host_is_broken(tmp_path: Path) -> None:
    storage = open_storage(_storage_url(tmp_path, "journal"))
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], check=True, capture_output=True, text=True, timeout=60
    )
    _hold(storage, socket.gethostname(), int(gone.stdout))
    with gate_lease(storage, "study", wait_s=5, poll_s=0.05) as waited:
        assert waited is False
    assert lease_name("study") not in [s.study_name for s in storage.get_all_studies()]


def test_a_live_holder_elsewhere_makes_the_wait_time_out_naming_it(tmp_path: Path) -> None:
    storage = open_storage(_storage_url(tmp_path, "journal"))
    _hold(storage, "machine-b", 4242)
    told: list[str] = []
    with (
        pytest.raises(GateLeaseTimeout, match=r"process 4242 on machine-b .*held the gate for more than 0.2 s"),
        gate_lease(storage, "study", wait_s=0.2, poll_s=0.05, on_wait=told.append),
    ):
        pass
    assert len(told) == 1 and "waiting for process 4242 on machine-b" in told[0]
    # The other holder's lease is left alone.
    assert lease_name("study") in [s.study_name for s in storage.get_all_studies()]


def test_a_cancel_ends_the_wait(tmp_path: Path) -> None:
    storage = open_storage(_storage_url(tmp_path, "journal"))
    _hold(storage, "machine-b", 4242)
    cancel = threading.Event()
    cancel.set()  # the user's Ctrl-C
    with pytest.raises(KeyboardInterrupt), gate_lease(storage, "study", wait_s=60, poll_s=0.05, cancel=cancel):
        pass
