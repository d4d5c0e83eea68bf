"""Parent side of the child protocol: run one measurement in its own process group, killed whole at the
deadline, so that whatever the model does ends that process only; trial failures are results, never exceptions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lightning_recompute.errors import RecomputeError
from lightning_recompute.policy import RecomputePolicy
from tuner._liveness import Owner, kill_point
from tuner._trials import forkserver
from tuner._trials.forkserver import SERVER_PARENT_ENV, Forked
from tuner._trials.oom import OOM_MARKERS, oom_evidence, oom_kill_count
from tuner._trials.protocol import (
    PARENT_PID_ENV,
    DeviceSpec,
    NumericsResult,
    NumericsSpec,
    ProfileSpec,
    RaceEntrant,
    RaceSpec,
    Spec,
    TrialSpec,
    rank_result_path,
)
from tuner.recipe import Recipe

if TYPE_CHECKING:
    from lightning_recompute.profile import Profile
    from lightning_recompute.race import RacePlan, RaceResult, Spread

Outcome = Literal["ok", "over_budget", "oom", "timeout", "error", "nonfinite", "skipped"]
"""``nonfinite``: it trained to a nan or inf loss (its figures are not evidence); ``skipped``: not run."""

_log = logging.getLogger(__name__)
_REAP_TIMEOUT_S = 60.0

_TAIL_CHARS = 4000
_DIR_PREFIX = "recompute-trial-"
_OWNER_FILE = "owner.json"
_WORKER_FILE = "worker.json"
TRIAL_DIR_ENV = "RECOMPUTE_TUNE_TRIAL_DIR"
"""The worker's trial folder, in its environment and so in everything it starts (`trial_processes`)."""


@dataclass(frozen=True)
class TrialResult:
    outcome: Outcome
    peak_bytes: int | None = None
    """Peak device memory over every step, warm-up included (a real job goes through those too)."""
    step_time_s: float | None = None
    """Median wall-clock seconds of the measured steps (warm-up excluded)."""
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    throughput: float | None = None
    """`tokens_per_s` when the batch has tokens, else `samples_per_s`: the search's objective."""
    throughput_unit: str = "samples/s"
    step_times_s: tuple[float, ...] = ()
    wall_s: float = 0.0
    compile_s: float | None = None
    """Seconds torch.compile spent on the policy's layers (in warm-up); ``None`` when it does not compile."""
    error: str | None = None
    stderr_tail: str | None = None
    device: str = ""
    device_total_bytes: int | None = None
    rank_peak_bytes: tuple[int, ...] = ()
    """Each rank's peak, rank 0 first, in a multi-rank trial (`peak_bytes` is their maximum)."""
    machine: dict[str, Any] = dataclasses.field(default_factory=dict)
    """`race.schedule.machine_state` while the trial ran."""
    batches: dict[str, Any] | None = None
    """`tuner._trials.batches.BatchScan`'s fields; ``None``: not measured."""

    @property
    def noise(self) -> Spread | None:
        from lightning_recompute.race.stats import spread

        return spread(self.step_times_s) if self.step_times_s else None

    @property
    def measured(self) -> bool:
        return self.outcome in ("ok", "over_budget")

    @classmethod
    def skipped(cls, reason: str, *, device: str = "") -> TrialResult:
        return cls(outcome="skipped", error=reason, device=device)


def run_trial(
    recipe: Recipe,
    policy: RecomputePolicy,
    *,
    micro_batch: int | None = None,
    warmup_steps: int | None = None,
    measure_steps: int | None = None,
    timeout_s: float | None = None,
    budget_bytes: int | None = None,
) -> TrialResult:
    """Train under ``policy`` for warm-up plus measured steps (default: ``recipe.trial``); a peak above
    ``budget_bytes`` is ``over_budget``; an exception while waiting (Ctrl-C) kills the trial."""
    spec = TrialSpec(
        **_recipe_fields(recipe, micro_batch),
        policy=policy.to_dict(),
        warmup_steps=recipe.trial.warmup_steps if warmup_steps is None else warmup_steps,
        measure_steps=recipe.trial.measure_steps if measure_steps is None else measure_steps,
    )
    run = _run_worker(spec, recipe.trial.timeout_s if timeout_s is None else timeout_s, recipe.trial.env)
    outcome: Outcome
    if run.payload is not None:
        try:
            return _measured(run.payload, wall_s=run.wall_s, budget_bytes=budget_bytes)
        except (KeyError, TypeError, ValueError) as err:
            outcome, error = "error", f"malformed worker result: {err!r}"
    else:
        outcome, error = run.failure("trial")
    res = run.result or {}
    unknown = "cpu" if recipe.trainer.accelerator == "cpu" else ""  # off the CPU, probing would cost a subprocess
    return TrialResult(
        outcome=outcome,
        wall_s=run.wall_s,
        error=error,
        stderr_tail=run.tail,
        device=str(res.get("device", unknown)),
        device_total_bytes=res.get("device_total_bytes"),
    )


def run_race(
    recipe: Recipe,
    entrants: Sequence[tuple[RecomputePolicy, Sequence[str]]],
    *,
    layer_names: Sequence[str],
    references: Sequence[RecomputePolicy] = (),
    micro_batch: int | None = None,
    budget_bytes: int | None = None,
    plan: RacePlan | None = None,
    timeout_s: float | None = None,
) -> RaceResult:
    """Race ``entrants`` (a policy and its labels; equal policies race once) on one model, in one subprocess;
    ``references``: what the winner's "vs" figures are about."""
    from lightning_recompute.race import RaceResult

    plan = plan or recipe.race_plan()
    labels: dict[str, list[str]] = {}
    policies: dict[str, RecomputePolicy] = {}
    for policy, why in entrants:
        key = policy.fingerprint()
        policies.setdefault(key, policy)
        labels.setdefault(key, []).extend(w for w in why if w not in labels.get(key, []))
    if not policies:
        return RaceResult(outcome="skipped", reason="no entrant")
    spec = RaceSpec(
        **_recipe_fields(recipe, micro_batch),
        entrants=tuple(RaceEntrant(key=k, policy=p.to_dict(), short=p.short(layer_names)) for k, p in policies.items()),
        references=tuple(p.fingerprint() for p in references if p.fingerprint() in policies),
        budget_bytes=budget_bytes,
        plan=plan.to_dict(),
    )
    limit = float(timeout_s) if timeout_s is not None else float(recipe.trial.timeout_s) + 2.0 * plan.time_s
    run = _run_worker(spec, limit, recipe.trial.env)
    if run.payload is None:
        outcome, error = run.failure("race")
        return RaceResult(outcome="failed", reason=f"the race ended {outcome}: {error}")
    try:
        return RaceResult.from_worker(run.payload, labels, {k: p.to_dict() for k, p in policies.items()})
    except (KeyError, TypeError, ValueError) as err:
        return RaceResult(outcome="failed", reason=f"malformed race result: {err!r}")


def check_numerics(
    recipe: Recipe, policy: RecomputePolicy, *, micro_batch: int | None = None, timeout_s: float | None = None
) -> NumericsResult:
    """Whether ``policy`` leaves one training step unchanged (`tuner._trials.worker._numerics`); a check that
    cannot run is not equal. Where no recompute runs out of memory on N ranks, the batch is halved here."""
    end = time.monotonic() + (600.0 if timeout_s is None else float(timeout_s))
    # cuBLAS reads this when its handle is created, so it must be in the starting environment. Not on the
    # CPU: an environment unlike the trials' would cost the fork server a restart.
    cublas = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if recipe.trainer.accelerator != "cpu" else {}
    size, skipped = micro_batch, []
    while True:
        spec = NumericsSpec(**_recipe_fields(recipe, size), policy=policy.to_dict())
        run = _run_worker(spec, max(1.0, end - time.monotonic()), {**cublas, **recipe.trial.env})
        if recipe.trainer.devices == 1 or run.timed_out or (run.result or {}).get("outcome") != "oom":
            break
        from tuner.recipe._build import data_batch_size

        current = size if size is not None else data_batch_size(recipe)
        if current is None or current <= 1:
            break
        skipped.append(current)
        size = current // 2
    if run.payload is None:
        outcome, error = run.failure("numerics check")
        tail = f": {_last_lines(run.tail, 5)}" if run.tail.strip() else ""
        return NumericsResult(False, float("inf"), f"the numerics check ended {outcome}: {error}{tail}")
    try:
        got = NumericsResult(**{f.name: run.payload[f.name] for f in dataclasses.fields(NumericsResult)})
    except (KeyError, TypeError) as err:
        return NumericsResult(False, float("inf"), f"malformed numerics result: {err!r}")
    halved = f" (no recompute ran out of memory at {', '.join(map(str, skipped))})" if skipped else ""
    return dataclasses.replace(got, detail=got.detail + halved)


def profile_recipe(recipe: Recipe, micro_batch: int | None = None, *, repeats: int = 3) -> Profile:
    """The profile of ``recipe``'s model; on an accelerator in a worker, as a CUDA context here would hold
    device memory that every trial then lacks."""
    from lightning_recompute.profile import Profile

    if recipe.trainer.accelerator == "cpu":
        from lightning_recompute.meter import CPU_MEMORY_LIMIT
        from tuner.recipe._profile import profile_recipe_here

        # On the device a worker would see: the recipe's cap on the CPU.
        cap, before = recipe.trial.env.get(CPU_MEMORY_LIMIT), os.environ.get(CPU_MEMORY_LIMIT)
        os.environ.update({CPU_MEMORY_LIMIT: cap} if cap is not None else {})
        try:
            return profile_recipe_here(recipe, micro_batch, repeats)
        finally:
            os.environ.pop(CPU_MEMORY_LIMIT, None)
            os.environ.update({CPU_MEMORY_LIMIT: before} if before is not None else {})
    spec = ProfileSpec(**_recipe_fields(recipe, micro_batch), repeats=repeats)
    run = _run_worker(spec, recipe.trial.timeout_s * 2, recipe.trial.env)
    if run.payload is None:
        raise RecomputeError(f"profiling failed: {run.failure('profile')[1]}")
    return Profile.from_dict(run.payload["profile"])


def device_info(recipe: Recipe) -> tuple[str, int | None]:
    """``("cpu", None)`` or ``(name, total bytes)``, queried in a subprocess: this one must hold no CUDA context."""
    return ("cpu", None) if recipe.trainer.accelerator == "cpu" else _probe_device(recipe.trainer.accelerator)


@functools.cache
def _probe_device(accelerator: str) -> tuple[str, int | None]:
    run = _run_worker(DeviceSpec(accelerator=accelerator), 120.0)
    if run.payload is None:
        raise RecomputeError(f"trainer.accelerator: cannot query the {accelerator!r} device: {run.failure('query')[1]}")
    return str(run.payload["device"]), run.payload.get("device_total_bytes")


def _recipe_fields(recipe: Recipe, micro_batch: int | None) -> dict[str, Any]:
    return {
        "recipe": recipe.to_dict(),
        "source": None if recipe.source is None else str(recipe.source),
        "micro_batch": micro_batch,
        "sys_path": (os.getcwd(), str(recipe.folder)),
    }


@dataclass(frozen=True)
class _WorkerRun:
    returncode: int | None
    result: dict[str, Any] | None
    tail: str
    wall_s: float
    timed_out: bool
    limit: float = 0.0
    oom: tuple[str | None, str] | None = None
    """For a worker killed by SIGKILL (not at its deadline): `oom.oom_evidence`."""

    @property
    def payload(self) -> dict[str, Any] | None:
        return self.result if not self.timed_out and (self.result or {}).get("outcome") == "ok" else None

    def failure(self, what: str) -> tuple[Outcome, str]:
        """``(outcome, one-line error)`` for a worker that produced no measurement."""
        res, code = self.result, self.returncode
        if self.timed_out:
            return "timeout", f"no result within {self.limit:g} s; the {what}'s process group was killed"
        if res is not None and res.get("outcome") in ("oom", "error", "nonfinite"):
            return res["outcome"], str(res.get("error") or "the worker reported an error")
        if any(marker in self.tail for marker in OOM_MARKERS):
            return "oom", "out of memory (the worker died before writing a result)"
        if code is None or code >= 0:
            said = _last_lines(self.tail, 1) or "no output"
            return "error", f"the worker exited with status {code} without a result: {said}"
        try:
            sig = signal.Signals(-code).name
        except ValueError:
            sig = f"signal {-code}"
        if -code != signal.SIGKILL:
            return "error", f"the worker was killed by {sig}: {_crash_summary(self.tail)}"
        # Not ours (a timeout is handled above). The kernel's out-of-memory killer sends it, but so do
        # `kill -9`, schedulers and container runtimes: oom only where the kernel records it.
        found, looked = self.oom or (None, "")
        if found is not None:
            return "oom", f"the worker was killed by signal {-code} ({sig}) for out of memory: {found}"
        looked = f"; {looked}" if looked else ""
        return "error", f"the worker was killed by signal {-code} ({sig}) from outside the tuner{looked}"


def _run_worker(spec: Spec, timeout_s: float, env: Mapping[str, str] | None = None) -> _WorkerRun:
    """Run the worker on ``spec`` with a deadline; kill its whole process group at the deadline."""
    with tempfile.TemporaryDirectory(prefix=_DIR_PREFIX) as tmp:
        folder = Path(tmp)
        spec_path, result_path, log_path = folder / "spec.json", folder / "result.json", folder / "output.log"
        # Whose folder this is: once this owner is dead, the next run here removes it (`clean_stale_trial_dirs`).
        (folder / _OWNER_FILE).write_text(json.dumps(Owner.me().to_dict()), encoding="utf-8")
        base_env = {**os.environ, **(env or {})}
        # The folder holding the `tuner` package, so `-m tuner._trials.worker` imports this very tuner.
        root = str(Path(__file__).resolve().parents[2])
        base_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, base_env.get("PYTHONPATH", "")) if p)
        base_env["PYTHONUNBUFFERED"] = "1"  # a killed worker's last words reach the log
        base_env["PYTHONFAULTHANDLER"] = "1"  # a segfault or abort() leaves a Python traceback in the log
        # Started (on first use) before the clock and the deadline: the server's imports are not the trial's.
        server = forkserver.shared(base_env, os.getcwd()) if _forkable(spec) else None
        start = time.monotonic()
        spec = spec.model_copy(update={"deadline": time.time() + timeout_s})
        spec_path.write_text(json.dumps(spec.to_dict()), encoding="utf-8")
        kills_before = oom_kill_count()
        argv = [str(spec_path), str(result_path)]
        env_ = {**base_env, TRIAL_DIR_ENV: str(folder), PARENT_PID_ENV: str(os.getpid())}
        proc: subprocess.Popen[bytes] | Forked | None = None
        if server is not None:
            proc = server.spawn(argv, {**env_, PARENT_PID_ENV: str(server.pid)}, str(log_path))
        if proc is None:
            with open(log_path, "wb") as log:
                # Output goes to a file, not a pipe: a child blocked on a full pipe would look hung.
                proc = subprocess.Popen(
                    [sys.executable, "-m", "tuner._trials.worker", *argv],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: one killpg ends it and its children
                    env=env_,
                )
        timed_out = False
        try:
            # For `trial_processes` to find what it leaves running.
            record = {"pid": proc.pid, "forked": isinstance(proc, Forked)}
            (folder / _WORKER_FILE).write_text(json.dumps(record), encoding="utf-8")
            kill_point("trial" if spec.kind == "trial" else "")  # a test hook; see tuner._liveness
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            # Also reaps anything the worker left behind (data-loader workers, compile helpers).
            if isinstance(proc, Forked):
                proc.kill_group()
            else:
                forkserver.kill_group(proc.pid)
            try:
                proc.wait(timeout=_REAP_TIMEOUT_S)
            except subprocess.TimeoutExpired:  # killed yet alive: stuck in the kernel (a hung driver, NFS)
                _log.warning(
                    "trial worker %d did not exit %g s after a kill; the session goes on", proc.pid, _REAP_TIMEOUT_S
                )
        wall = time.monotonic() - start
        if spec.ranks == 1:
            result = _read_result(result_path)
        else:
            result = merge_ranks(spec.kind, [_read_result(rank_result_path(result_path, r)) for r in range(spec.ranks)])
        killed = not timed_out and proc.returncode == -signal.SIGKILL
        evidence = oom_evidence(proc.pid, kills_before) if killed else None
        return _WorkerRun(proc.returncode, result, _tail(log_path), wall, timed_out, timeout_s, evidence)


def _forkable(spec: Spec) -> bool:
    """Whether a forked worker is exactly a fresh one for ``spec`` (why: `tuner._trials.forkserver`)."""
    return sys.platform.startswith("linux") and spec.runs_on == "cpu" and spec.ranks == 1


def _read_result(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None  # none, or (written atomically) something else wrote there
    return data if isinstance(data, dict) else None


def merge_ranks(kind: str, reports: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """One result from each rank's (``None``: one missing): ``oom`` if a rank was; steps merge to the slowest
    rank's time, the highest peak and every rank's samples."""
    failed = [(r, rep) for r, rep in enumerate(reports) if rep is not None and rep.get("outcome") != "ok"]
    if failed:
        rank, rep = next(((r, f) for r, f in failed if f.get("outcome") == "oom"), failed[0])
        error = f"rank {rank} of {len(reports)}: {rep.get('error') or 'failed'}"
        return {**rep, "outcome": rep.get("outcome", "error"), "error": error}
    done = [dict(rep) for rep in reports if rep is not None]
    if len(done) < len(reports):
        return None
    if kind == "numerics":
        unequal = [f"rank {r}: {rep['detail']}" for r, rep in enumerate(done) if not rep["equal"]]
        return {
            **done[0],
            "equal": not unequal,
            "max_abs_diff": max(float(rep["max_abs_diff"]) for rep in done),
            "baseline_spread": max(float(rep.get("baseline_spread", 0.0)) for rep in done),
            "detail": "; ".join(unequal) if unequal else f"{done[0]['detail']}, and on every rank of {len(done)}",
        }
    per_rank = [rep["steps"] for rep in done]
    steps = []
    for column in zip(*per_rank, strict=False):  # a rank with fewer records: the shortest decides
        peaks = [int(s["peak_bytes"]) for s in column if s.get("peak_bytes") is not None]
        tokens = [s.get("tokens") for s in column]
        steps.append(
            {
                "seconds": max(float(s["seconds"]) for s in column),
                "peak_bytes": max(peaks) if peaks else None,
                "samples": sum(int(s["samples"]) for s in column),
                "tokens": None if None in tokens else sum(int(t) for t in tokens),
            }
        )
    rank_peaks = [[int(s["peak_bytes"]) for s in rank if s.get("peak_bytes") is not None] for rank in per_rank]
    return {**done[0], "steps": steps, "rank_peak_bytes": [max(p) for p in rank_peaks] if all(rank_peaks) else []}


def clean_stale_trial_dirs(tmp_root: str | Path | None = None) -> list[Path]:
    """Remove the trial folders of dead owners on this host (a SIGKILLed tuner cannot), ending what their
    workers left; never one without an owner record (it may be being created)."""
    removed = []
    for folder in sorted(Path(tmp_root or tempfile.gettempdir()).glob(f"{_DIR_PREFIX}*")):
        try:
            owner = Owner.from_dict(json.loads((folder / _OWNER_FILE).read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
        if owner is None or not owner.here or owner.gone_here() is None:
            continue
        for pid in trial_processes(folder):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            removed.append(folder)
            _log.info("removed %s: its owner %s is gone", folder, owner.describe())
    return removed


def trial_processes(folder: Path) -> list[int]:
    """The processes still running for ``folder``: those with it in their environment, or, for a forked worker,
    in its session with the fork server's parent the folder's owner."""
    found = set(_pids_with_env(TRIAL_DIR_ENV, str(folder)))
    try:
        worker = json.loads((folder / _WORKER_FILE).read_text(encoding="utf-8"))
        leader, forked = int(worker["pid"]), worker.get("forked") is True
        owner = Owner.from_dict(json.loads((folder / _OWNER_FILE).read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return sorted(found)
    if forked and owner is not None:
        by_server = set(_pids_with_env(SERVER_PARENT_ENV, str(owner.pid)))
        found.update(pid for pid in _pids_in_session(leader) if pid in by_server)
    return sorted(found)


def _pids(matches: Callable[[Path], bool]) -> list[int]:
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            if matches(entry):
                pids.append(int(entry.name))
    return pids


def _pids_in_session(session: int) -> list[int]:
    return _pids(lambda entry: os.getsid(int(entry.name)) == session)


def _pids_with_env(name: str, value: str) -> list[int]:
    needle = f"{name}={value}".encode()
    return _pids(lambda entry: needle in (entry / "environ").read_bytes().split(b"\0"))


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - 4 * _TAIL_CHARS))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    # faulthandler's list of ~100 C extension modules would push the traceback out of the tail.
    lines = [line for line in text.splitlines() if not line.startswith("Extension modules:")]
    return "\n".join(lines)[-_TAIL_CHARS:]


def _last_lines(text: str, n: int) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-n:] if line.strip())


def _crash_summary(tail: str) -> str:
    """faulthandler's verdict and the innermost frame (it prints the most recent call first)."""
    lines = tail.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Fatal Python error"):
            frame = next((f.strip() for f in lines[i + 1 :] if f.strip().startswith("File ")), "")
            return f"{line.strip()}{' at ' + frame if frame else ''}"
    return _last_lines(tail, 1) or "no output"


def _measured(res: Mapping[str, Any], *, wall_s: float, budget_bytes: int | None) -> TrialResult:
    stats = summarize_steps(res["steps"], int(res["warmup_steps"]))
    peak = stats["peak_bytes"]
    over = budget_bytes is not None and peak is not None and peak > budget_bytes
    return TrialResult(
        outcome="over_budget" if over else "ok",
        wall_s=wall_s,
        error=f"peak {peak} bytes exceeds the budget limit of {budget_bytes} bytes" if over else None,
        device=str(res.get("device", "")),
        device_total_bytes=res.get("device_total_bytes"),
        rank_peak_bytes=tuple(int(v) for v in res.get("rank_peak_bytes", ())),
        compile_s=res.get("compile_s"),
        machine=dict(res.get("machine") or {}),
        batches=res.get("batches"),
        **stats,
    )


def summarize_steps(steps: Sequence[Mapping[str, Any]], warmup_steps: int) -> dict[str, Any]:
    """Peak memory (warm-up included) and median speed from per-step records; where some steps ran unmetered
    (``peak_bytes`` None: the CPU worker), only those are timed, without the meter's cost."""
    measured = list(steps[warmup_steps:])
    if not measured:
        raise ValueError(f"{len(steps)} step(s) recorded, none after {warmup_steps} warm-up step(s)")
    measured = [s for s in measured if s.get("peak_bytes") is None] or measured
    times = [float(s["seconds"]) for s in measured]
    step_time = statistics.median(times)
    peaks = [int(s["peak_bytes"]) for s in steps if s.get("peak_bytes") is not None]
    tokens = [int(s["tokens"]) for s in measured if s.get("tokens") is not None]
    samples_per_s = statistics.median(int(s["samples"]) for s in measured) / step_time if step_time > 0 else None
    tokens_per_s = statistics.median(tokens) / step_time if len(tokens) == len(measured) and step_time > 0 else None
    return {
        "peak_bytes": max(peaks) if peaks else None,
        "step_time_s": step_time,
        "samples_per_s": samples_per_s,
        "tokens_per_s": tokens_per_s,
        "throughput": tokens_per_s if tokens_per_s is not None else samples_per_s,
        "throughput_unit": "tokens/s" if tokens_per_s is not None else "samples/s",
        "step_times_s": tuple(times),
    }
