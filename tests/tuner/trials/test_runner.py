"""Trials in subprocesses: measured on the reference model; OOM, crashes and hangs classified; numerics checked.

Every trial here is a real subprocess running a real Lightning Trainer on a tiny model (2 layers,
width 32, 32 tokens, 1 warm-up + 2 measured steps); the failures come from `tests.tuner.faulty`.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lightning_recompute import RecomputePolicy
from tests.helpers import REPO, process_alive
from tuner import recipe as R
from tuner._trials import NumericsResult, TrialResult, check_numerics, device_info, run_trial, summarize_steps
from tuner.recipe._schema import REFERENCE_MODEL

TINY = {"n_layer": 2, "n_embd": 32, "n_head": 4, "seq_len": 32}
BATCH = 4


def _recipe(tmp_path: Path, model: str = REFERENCE_MODEL, timeout_s: float = 300, **init_args: Any) -> R.Recipe:
    """A tiny reference-model recipe; ``timeout_s`` is a deadline for a hang, not a speed bound: four
    workers start at once here on two cores, and the gate's numerics check builds its model several times."""
    return R.from_dict(
        {
            "budget": "1GiB",
            "model": {"class_path": model, "init_args": {**TINY, **init_args}},
            "data": {"init_args": {"batch_size": BATCH, "num_batches": 4}},
            "trial": {"warmup_steps": 1, "measure_steps": 2, "timeout_s": timeout_s, "env": {"OMP_NUM_THREADS": 1}},
        },
        source=tmp_path / "recipe.yaml",
    )


# ---------------------------------------------------------------------------------------------- the runs

HANG_TIMEOUT_S = 150.0  # the worker needs ~5 s to import torch and Lightning on a quiet machine, 35-50 s
# on two cores shared with several test runs (this fixture starts four at once, beside another test): the
# stack dump below needs it to reach training_step first, and only this job waits its deadline out


@dataclass
class _Timed:
    result: Any
    elapsed_s: float


def _timed(fn: Any, *args: Any, **kwargs: Any) -> _Timed:
    start = time.monotonic()
    return _Timed(fn(*args, **kwargs), time.monotonic() - start)


def _ok_then_over_budget(folder: Path) -> tuple[TrialResult, TrialResult]:
    recipe = _recipe(folder)
    full = run_trial(recipe, RecomputePolicy.uniform("full"))
    # A budget one byte above full's peak: keeping everything cannot fit.
    budget = (full.peak_bytes or 0) + 1
    return full, run_trial(recipe, RecomputePolicy.uniform("none"), budget_bytes=budget)


def _gate(recipe: R.Recipe) -> Any:
    """The evidence gate with its real runners, on ``full`` (recomputes all six blocks: fits)."""
    from tuner._gate import evaluate

    return evaluate(RecomputePolicy.uniform("full"), None, recipe=recipe, budget_bytes=None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, _Timed]:
    """Every subprocess this file needs, run side by side.

    Trials are independent processes with their own temporary folders, so the parent can run
    them concurrently (as several search workers do); this keeps the file's wall time near that
    of the longest one, the hang.
    """
    folder = tmp_path_factory.mktemp("trials")
    faulty = "tests.tuner.faulty."
    jobs: dict[str, tuple[Any, ...]] = {
        "hang": (
            run_trial,
            _recipe(folder, faulty + "Hangs", timeout_s=HANG_TIMEOUT_S, pid_file=str(folder / "pids")),
            RecomputePolicy.uniform("full"),
        ),
        "measured": (_ok_then_over_budget, folder),
        "RaisesOOM": (run_trial, _recipe(folder, faulty + "RaisesOOM"), RecomputePolicy.uniform("full")),
        "AllocatesTooMuch": (run_trial, _recipe(folder, faulty + "AllocatesTooMuch"), RecomputePolicy.uniform("full")),
        "RaisesError": (run_trial, _recipe(folder, faulty + "RaisesError"), RecomputePolicy.uniform("none")),
        "Aborts": (run_trial, _recipe(folder, faulty + "Aborts"), RecomputePolicy.uniform("none")),
        "numerics_equal": (
            check_numerics,
            _recipe(folder, dropout=0.2),
            RecomputePolicy.from_modes({"blocks.0": "selective", "blocks.1": "full"}),
        ),
        "numerics_differ": (check_numerics, _recipe(folder, faulty + "CountsCalls"), RecomputePolicy.uniform("full")),
        # Six blocks, room for 8 block-samples: at the micro-batch of 4, no recompute cannot run.
        "gate_needs_recompute": (_gate, _recipe(folder, faulty + "OOMUnlessRecomputed", n_layer=6)),
        "gate_broken_replay": (_gate, _recipe(folder, faulty + "BrokenReplay", n_layer=6)),
    }
    with pytest.MonkeyPatch.context() as mp:
        # The worker imports class_path modules from its working directory (LightningCLI's
        # convention), so `tests.tuner.faulty` must be importable from there.
        mp.chdir(REPO)
        with ThreadPoolExecutor(max_workers=4) as pool:
            futures = {name: pool.submit(_timed, *job) for name, job in jobs.items()}
            out = {name: f.result() for name, f in futures.items()}
    out["pid_file"] = _Timed(folder / "pids", 0.0)
    return out


# ---------------------------------------------------------------------------------------------- measured


def test_summarize_steps_excludes_warmup_from_time_but_not_from_memory() -> None:
    steps = [
        {"seconds": 9.0, "peak_bytes": 500, "samples": 4, "tokens": 128},  # warm-up: slow, and the highest peak
        {"seconds": 1.0, "peak_bytes": 300, "samples": 4, "tokens": 128},
        {"seconds": 3.0, "peak_bytes": 300, "samples": 4, "tokens": 128},
        {"seconds": 2.0, "peak_bytes": 300, "samples": 4, "tokens": 128},
    ]
    s = summarize_steps(steps, warmup_steps=1)
    assert s["step_time_s"] == 2.0
    assert s["step_times_s"] == (1.0, 3.0, 2.0)
    assert s["peak_bytes"] == 500
    assert (s["samples_per_s"], s["tokens_per_s"], s["throughput"], s["throughput_unit"]) == (
        2.0,
        64.0,
        64.0,
        "tokens/s",
    )
    untokenised = [{**st, "tokens": None} for st in steps]
    s = summarize_steps(untokenised, warmup_steps=1)
    assert (s["tokens_per_s"], s["throughput"], s["throughput_unit"]) == (None, 2.0, "samples/s")
    with pytest.raises(ValueError, match="none after 4 warm-up"):
        summarize_steps(steps, warmup_steps=4)


def test_summarize_steps_times_only_unmetered_steps_when_there_are_some() -> None:
    steps = [
        {"seconds": 9.0, "peak_bytes": 400, "samples": 4, "tokens": None},  # warm-up, metered
        {"seconds": 5.0, "peak_bytes": 500, "samples": 4, "tokens": None},  # metered: slow because of the meter
        {"seconds": 1.0, "peak_bytes": None, "samples": 4, "tokens": None},
        {"seconds": 2.0, "peak_bytes": None, "samples": 4, "tokens": None},
    ]
    s = summarize_steps(steps, warmup_steps=1)
    assert s["step_times_s"] == (1.0, 2.0) and s["step_time_s"] == 1.5
    assert s["peak_bytes"] == 500


@pytest.mark.slow
def test_reference_model_trials_measure_and_full_recompute_peaks_lower(runs: dict[str, _Timed]) -> None:
    full, none = runs["measured"].result
    assert full.outcome == "ok", full.stderr_tail
    assert full.error is None and full.device == "cpu" and full.device_total_bytes is None
    assert full.peak_bytes is not None and full.peak_bytes > 0
    assert len(full.step_times_s) == 2 and all(t > 0 for t in full.step_times_s)
    assert full.step_time_s == pytest.approx(sum(full.step_times_s) / 2)  # the median of two
    assert full.throughput_unit == "tokens/s"
    assert full.tokens_per_s == pytest.approx(BATCH * TINY["seq_len"] / full.step_time_s)
    assert full.samples_per_s == pytest.approx(BATCH / full.step_time_s)
    assert full.throughput == full.tokens_per_s
    assert full.wall_s > full.step_time_s * 2

    # Over the budget is reported so, with its measurements.
    assert none.outcome == "over_budget", none.stderr_tail
    assert none.peak_bytes is not None and none.peak_bytes > full.peak_bytes
    assert none.throughput is not None and len(none.step_times_s) == 2
    assert str(full.peak_bytes + 1) in (none.error or "")


# ---------------------------------------------------------------------------------------------- failures


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("RaisesOOM", "OutOfMemoryError: CUDA out of memory"),
        ("AllocatesTooMuch", "DefaultCPUAllocator: can't allocate memory"),
    ],
)
def test_out_of_memory_is_oom(runs: dict[str, _Timed], model: str, message: str) -> None:
    result = runs[model].result
    assert result.outcome == "oom"
    assert message in (result.error or "")
    assert result.stderr_tail and "faulty.py" in result.stderr_tail  # the traceback, down to the raise
    assert result.peak_bytes is None and result.throughput is None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "message", "in_tail"),
    [
        ("RaisesError", "RuntimeError: injected failure", "faulty.py"),
        ("Aborts", "killed by SIGABRT: Fatal Python error: Aborted at File", "Aborts: about to abort()"),
    ],
)
def test_crashes_are_errors_with_the_output_tail(
    runs: dict[str, _Timed], model: str, message: str, in_tail: str
) -> None:
    result = runs[model].result
    assert result.outcome == "error"
    assert message in (result.error or ""), result.error
    assert result.stderr_tail and in_tail in result.stderr_tail
    assert "training_step" in result.stderr_tail  # where it failed


@pytest.mark.slow
def test_hang_is_killed_with_its_children_at_the_timeout(runs: dict[str, _Timed]) -> None:
    result, elapsed = runs["hang"].result, runs["hang"].elapsed_s
    assert result.outcome == "timeout"
    # Never before the deadline; how long after it depends on the machine's load, so no upper bound:
    # that the process group is gone (below) is what shows the deadline was enforced.
    assert elapsed >= HANG_TIMEOUT_S and (result.wall_s or 0.0) >= HANG_TIMEOUT_S
    assert f"{HANG_TIMEOUT_S:g} s" in (result.error or "")
    # The worker dumped its stacks just before the deadline: the tail says where it hung.
    assert result.stderr_tail and "in training_step" in result.stderr_tail
    worker_pid, child_pid = (int(p) for p in runs["pid_file"].result.read_text().split())
    deadline = time.monotonic() + 60  # SIGKILL was sent; the margin is for a loaded machine to reap them
    while (process_alive(worker_pid) or process_alive(child_pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_alive(worker_pid) and not process_alive(child_pid)


# ---------------------------------------------------------------------------------------------- numerics


@pytest.mark.slow
def test_numerics_equal_under_full_and_selective(runs: dict[str, _Timed]) -> None:
    result = runs["numerics_equal"].result
    assert result == NumericsResult(equal=True, max_abs_diff=0.0, detail=result.detail, micro_batch=BATCH)
    assert "bitwise equal at micro-batch 4" in result.detail


@pytest.mark.slow
def test_numerics_catch_a_layer_that_recomputes_differently(runs: dict[str, _Timed]) -> None:
    result = runs["numerics_differ"].result
    assert not result.equal
    assert 0 < result.max_abs_diff < float("inf")
    # Two runs without recompute agree bitwise, so the difference is the recomputation's.
    assert result.baseline_spread == 0.0
    assert "and the eval-mode loss) differ at micro-batch 4, first gradient of " in result.detail, result.detail
    assert "bitwise equality is the rule on CPU" in result.detail


@pytest.mark.slow
def test_the_gate_promotes_where_no_recompute_does_not_fit(runs: dict[str, _Timed]) -> None:
    decision = runs["gate_needs_recompute"].result
    assert decision.promoted, decision.reasons
    assert decision.checks == {"confirmation": "passed", "numerics": "passed", "regression": "passed"}
    numerics = decision.evidence["numerics"]
    # No recompute ran out of memory at 4 and 2 (24 and 12 block-samples); at 1 it fits and is compared.
    assert (numerics["equal"], numerics["micro_batch"], numerics["baseline_spread"]) == (True, 1, 0.0)
    assert "at micro-batch 1 (no recompute ran out of memory at 4, 2)" in numerics["detail"]


@pytest.mark.slow
def test_the_gate_rejects_a_recomputation_that_replays_another_dropout_mask(runs: dict[str, _Timed]) -> None:
    decision = runs["gate_broken_replay"].result
    assert not decision.promoted
    assert decision.checks == {"confirmation": "passed", "numerics": "failed", "regression": "not run"}
    assert decision.evidence["numerics"]["micro_batch"] == 1
    assert decision.reasons[0].startswith("numerics: numerics differ from no recompute")


# ---------------------------------------------------------------------------------------------- small parts


def test_device_info_on_cpu_needs_no_subprocess(tmp_path: Path) -> None:
    assert device_info(_recipe(tmp_path)) == ("cpu", None)


def test_a_skipped_trial_measured_nothing() -> None:
    skipped = TrialResult.skipped("predicted 3.1 GiB, budget 2 GiB", device="cpu")
    assert skipped.outcome == "skipped" and not skipped.measured and skipped.error == "predicted 3.1 GiB, budget 2 GiB"


@pytest.mark.slow
def test_a_worker_killed_from_outside_is_killed_by_signal_9_not_oom(tmp_path: Path) -> None:
    # Every SIGKILL used to be recorded as oom ("most likely the kernel's out-of-memory killer").
    import os
    import signal
    import threading

    pid_file = tmp_path / "pids"
    recipe = _recipe(tmp_path, "tests.tuner.faulty.Hangs", timeout_s=300, pid_file=str(pid_file))

    def kill_when_training() -> None:
        deadline = time.monotonic() + 240
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)

    killer = threading.Thread(target=kill_when_training, daemon=True)
    killer.start()
    result = run_trial(recipe, RecomputePolicy.uniform("full"))
    killer.join(5)
    assert result.outcome == "error", result
    assert (result.error or "").startswith("the worker was killed by signal 9 (SIGKILL) from outside the tuner; ")


def _fake_cgroup(root: Path, kills: int) -> None:
    (root / "memory").mkdir(parents=True, exist_ok=True)
    (root / "memory.events").write_text(f"low 0\nhigh 0\nmax 0\noom 1\noom_kill {kills}\n")
    (root / "memory" / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {kills}\n")


def test_a_sigkill_is_oom_only_where_the_kernel_records_an_oom_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tuner._trials import oom, runner

    monkeypatch.setattr(oom, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(oom, "KMSG", tmp_path / "no-kmsg")
    _fake_cgroup(tmp_path, 2)
    before = oom.oom_kill_count()
    assert before == 2

    def killed(evidence: tuple[str | None, str]) -> tuple[str, str]:
        run = runner._WorkerRun(returncode=-9, result=None, tail="", wall_s=1.0, timed_out=False, oom=evidence)
        return run.failure("trial")

    # Nothing new in the cgroup, no kernel log: killed by a signal, not out of memory.
    outcome, error = killed(oom.oom_evidence(4242, before))
    assert outcome == "error"
    assert error == (
        "the worker was killed by signal 9 (SIGKILL) from outside the tuner; the cgroup's oom_kill counter "
        "records no out-of-memory kill"
    )
    # The counter grew during the trial: the out-of-memory killer, and where that is recorded.
    _fake_cgroup(tmp_path, 3)
    outcome, error = killed(oom.oom_evidence(4242, before))
    assert (outcome, error) == (
        "oom",
        "the worker was killed by signal 9 (SIGKILL) for out of memory: the cgroup's oom_kill counter went from 2 to 3",
    )
    # Nothing readable: unknown, and said so.
    monkeypatch.setattr(oom, "CGROUP_ROOT", tmp_path / "absent")
    outcome, error = killed(oom.oom_evidence(4242, None))
    assert outcome == "error" and error.endswith("whether it was the kernel's out-of-memory killer is unknown")
