"""Workers forked from the warm fork server: exactly what a fresh interpreter measures, and no process left behind.

The slow tests run real trials on a tiny reference model (2 layers, width 32, 32 tokens) with the
server on and off; `test_runner.py`'s failure cases (OOM, crash, abort, hang) run through it too,
since every one-rank CPU trial is forked.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_recompute import RecomputePolicy
from tests.helpers import REPO, process_alive
from tuner import recipe as R
from tuner._trials import check_numerics, run_trial, runner
from tuner._trials.forkserver import FORK_SERVER_ENV, Forked, ForkServer, forking
from tuner._trials.protocol import DeviceSpec, NumericsSpec
from tuner.recipe._schema import REFERENCE_MODEL

TINY = {"n_layer": 2, "n_embd": 32, "n_head": 4, "seq_len": 32}
DEADLINE_S = 240.0  # for a process to appear or go on a loaded machine; not a speed bound


def _recipe(tmp_path: Path, model: str = REFERENCE_MODEL, **trial: Any) -> R.Recipe:
    return R.from_dict(
        {
            "budget": "1GiB",
            "model": {"class_path": model, "init_args": {**TINY, **trial.pop("init_args", {})}},
            "data": {"init_args": {"batch_size": 4, "num_batches": 4}},
            "trial": {"warmup_steps": 1, "measure_steps": 3, "timeout_s": 300, **trial},
        },
        source=tmp_path / "recipe.yaml",
    )


def _wait_gone(*pids: int) -> bool:
    deadline = time.monotonic() + 60  # SIGKILL was sent: the margin is for a loaded machine to reap
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(process_alive(p) for p in pids)


class _Spawns:
    """Records the workers the fork server forks (the server itself is real)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.forked: list[Forked] = []
        self.servers: list[int] = []
        spawn = ForkServer.spawn

        def recording(server: ForkServer, *args: Any, **kwargs: Any) -> Forked | None:
            forked = spawn(server, *args, **kwargs)
            if forked is not None:
                self.forked.append(forked)
                self.servers.append(server.pid)
            return forked

        monkeypatch.setattr(ForkServer, "spawn", recording)


@pytest.fixture
def spawns(monkeypatch: pytest.MonkeyPatch) -> _Spawns:
    monkeypatch.chdir(REPO)  # the worker imports `tests.tuner.faulty` class paths from its working directory
    monkeypatch.delenv(FORK_SERVER_ENV, raising=False)  # the default: on
    return _Spawns(monkeypatch)


# ---------------------------------------------------------------------------------------------- exactness


@pytest.mark.slow
def test_a_forked_trial_measures_what_a_fresh_interpreter_measures_and_keeps_recomputation_exact(
    tmp_path: Path, spawns: _Spawns, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = _recipe(tmp_path, init_args={"dropout": 0.2})
    policy = RecomputePolicy.from_modes({"blocks.0": "selective", "blocks.1": "full"})
    forked = run_trial(recipe, policy)
    numerics = check_numerics(recipe, policy)
    assert len(spawns.forked) == 2, "both ran forked"
    assert spawns.servers[0] == spawns.servers[1], "the numerics check's environment is the trials': one server"
    monkeypatch.setenv(FORK_SERVER_ENV, "0")
    fresh = run_trial(recipe, policy)
    assert len(spawns.forked) == 2, "RECOMPUTE_TUNE_FORK_SERVER=0: a fresh interpreter"
    assert forked.outcome == fresh.outcome == "ok", (forked, fresh)
    # The exact CPU storage ledger: the same peak to the byte, over the same steps.
    assert forked.peak_bytes == fresh.peak_bytes
    assert len(forked.step_times_s) == len(fresh.step_times_s) == 3
    # Bitwise gradients under recomputation, dropout included, in a forked worker.
    assert numerics.equal, numerics


@pytest.mark.slow
def test_the_server_serves_the_next_worker_and_another_environment_gets_its_own(
    tmp_path: Path, spawns: _Spawns
) -> None:
    one = _recipe(tmp_path, env={"OMP_NUM_THREADS": 1})
    assert run_trial(one, RecomputePolicy.uniform("full")).outcome == "ok"
    assert run_trial(one, RecomputePolicy.uniform("none")).outcome == "ok"
    first = spawns.servers[0]
    assert spawns.servers == [first, first], "one server, kept between workers"
    # OMP_NUM_THREADS is read when the OpenMP runtime loads, in the server: another value needs
    # another server, and the old one is ended.
    two = _recipe(tmp_path, env={"OMP_NUM_THREADS": 2})
    assert run_trial(two, RecomputePolicy.uniform("full")).outcome == "ok"
    assert len(spawns.servers) == 3 and spawns.servers[2] != first
    assert _wait_gone(first)


# ---------------------------------------------------------------------------------------------- failures


@pytest.mark.slow
def test_a_worker_dies_with_its_server_and_the_next_trial_gets_a_new_server(
    tmp_path: Path, spawns: _Spawns, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid_file = tmp_path / "pids"
    hangs = _recipe(tmp_path, "tests.tuner.faulty.Hangs", init_args={"pid_file": str(pid_file)})

    def kill_the_server_when_training() -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(spawns.servers[0], signal.SIGKILL)

    # The runner kills the worker's group itself once it hears of the server's death; whether the
    # worker had already died on its own (it follows its server, PR_SET_PDEATHSIG) is noted first.
    died_on_its_own: list[bool] = []
    kill_group = Forked.kill_group

    def noting(forked: Forked) -> None:
        if not died_on_its_own:
            died_on_its_own.append(_wait_gone(forked.pid))
        kill_group(forked)

    monkeypatch.setattr(Forked, "kill_group", noting)
    killer = threading.Thread(target=kill_the_server_when_training, daemon=True)
    killer.start()
    result = run_trial(hangs, RecomputePolicy.uniform("full"))
    killer.join(DEADLINE_S)
    # Long before its 300 s deadline; its own child is killed with its process group.
    assert result.outcome == "error" and (result.error or "").startswith("the worker was killed by signal 9"), result
    worker, child = (int(p) for p in pid_file.read_text().split())
    assert worker == spawns.forked[0].pid and died_on_its_own == [True]
    assert _wait_gone(worker, child)
    after = run_trial(_recipe(tmp_path), RecomputePolicy.uniform("full"))
    assert after.outcome == "ok" and len(spawns.servers) == 2 and spawns.servers[1] != spawns.servers[0]


@pytest.mark.slow
def test_a_forked_worker_past_its_deadline_is_killed_with_its_children_and_the_server_serves_on(
    tmp_path: Path, spawns: _Spawns
) -> None:
    pid_file = tmp_path / "pids"
    # A deadline, not a speed bound: a forked worker reaches its first step in a second or two.
    hangs = _recipe(tmp_path, "tests.tuner.faulty.Hangs", timeout_s=30, init_args={"pid_file": str(pid_file)})
    result = run_trial(hangs, RecomputePolicy.uniform("full"))
    assert result.outcome == "timeout", result
    worker, child = (int(p) for p in pid_file.read_text().split())
    assert worker == spawns.forked[0].pid
    assert _wait_gone(worker, child)
    assert run_trial(_recipe(tmp_path), RecomputePolicy.uniform("full")).outcome == "ok"
    assert spawns.servers == [spawns.servers[0]] * 2, "the server killed its worker on request and serves on"


@pytest.mark.slow
def test_the_server_outlives_the_thread_that_started_it_and_threads_at_once_take_turns(
    tmp_path: Path, spawns: _Spawns
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    recipe = _recipe(tmp_path)
    # The pool's threads start the server and end: PR_SET_PDEATHSIG would follow the starting
    # thread and kill the server with it; the server follows the tuning process instead.
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda mode: run_trial(recipe, RecomputePolicy.uniform(mode)), ["full", "none"]))
    assert [r.outcome for r in results] == ["ok", "ok"]
    # One server runs one worker at a time: a second thread's trial at the same moment starts fresh.
    assert 1 <= len(spawns.forked) <= 2
    server = spawns.servers[0]
    assert run_trial(recipe, RecomputePolicy.uniform("selective")).outcome == "ok"
    assert spawns.servers[-1] == server, "the same server, after the threads that started it ended"


# ---------------------------------------------------------------------------------------------- no process


def test_only_one_rank_on_the_cpu_is_forked(tmp_path: Path) -> None:
    policy = RecomputePolicy.uniform("full")
    cpu = R.from_dict({"budget": "1GiB"}, source=tmp_path / "r.yaml")
    two_ranks = R.from_dict({"budget": "1GiB", "trainer": {"devices": 2}}, source=tmp_path / "r.yaml")
    cuda = R.from_dict({"budget": "1GiB", "trainer": {"accelerator": "cuda"}}, source=tmp_path / "r.yaml")

    def numerics(recipe: R.Recipe) -> NumericsSpec:
        return NumericsSpec(recipe=recipe.to_dict(), policy=policy.to_dict())

    assert runner._forkable(numerics(cpu))
    assert not runner._forkable(numerics(two_ranks))
    assert not runner._forkable(numerics(cuda))
    assert not runner._forkable(DeviceSpec(accelerator="cuda"))


@pytest.mark.parametrize(
    ("value", "on"), [("", True), ("1", True), ("0", False), ("off", False), (" False", False), ("no", False)]
)
def test_the_fork_server_is_on_unless_turned_off(value: str, on: bool) -> None:
    assert forking({FORK_SERVER_ENV: value}) is on
    assert forking({}) is True


def test_a_value_neither_on_nor_off_keeps_forking_on_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="tuner._trials.forkserver"):
        assert forking({FORK_SERVER_ENV: "disable"}) is True
        assert forking({FORK_SERVER_ENV: "disable"}) is True
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "RECOMPUTE_TUNE_FORK_SERVER='disable'" in warned[0] and "0, off" in warned[0]


def test_a_server_running_a_worker_forks_no_second_one() -> None:
    server = ForkServer.__new__(ForkServer)  # its state only: the fast tier starts no process
    server._busy = threading.Lock()
    server._busy.acquire()
    assert server.busy and server.spawn(["spec.json", "result.json"], {}, "output.log") is None


def test_a_session_s_members_are_found_by_its_id() -> None:
    assert os.getpid() in runner._pids_in_session(os.getsid(0))
    assert os.getpid() not in runner._pids_in_session(os.getpid() if os.getsid(0) != os.getpid() else 1)
