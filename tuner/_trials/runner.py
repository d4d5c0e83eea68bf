"""Parent side of the child protocol: run one measurement in a fresh subprocess and classify what happened.

Each measurement runs ``python -m tuner._trials.worker SPEC.json RESULT.json`` in its own session, so
whatever the model does (run out of memory, crash, hang) ends that process only, and its whole group is
killed at the deadline. Trial failures are results (``oom``, ``timeout``, ``error``), never exceptions.
One-rank CPU workers are forked from a warm fork server instead (`tuner._trials.forkserver`).
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
from typing import TYPE_CHECKING, Any, Literal, get_args

from lightning_recompute.errors import RecomputeError
from lightning_recompute.policy import RecomputePolicy
from tuner._liveness import Owner, kill_point
from tuner._trials import forkserver
from tuner._trials.forkserver import SERVER_PARENT_ENV, Forked
from tuner._trials.oom import OOM_MARKERS, OomEvidence, oom_evidence, oom_kill_count
from tuner._trials.protocol import (
    PARENT_PID_ENV,
    RANKED_KINDS,
    DeviceSpec,
    NumericsPayload,
    NumericsSpec,
    ProfileSpec,
    ProtocolError,
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
"""What became of a trial: measured and within budget; measured above the budget; out of memory;
killed at its deadline; failed otherwise; ran to a nan or inf training loss (its figures are not
evidence); or not run (the planner predicted it far over budget)."""

_log = logging.getLogger(__name__)

_TAIL_CHARS = 4000
_DIR_PREFIX = "recompute-trial-"
_OWNER_FILE = "owner.json"
_WORKER_FILE = "worker.json"
TRIAL_DIR_ENV = "RECOMPUTE_TUNE_TRIAL_DIR"
"""The worker's trial folder, in its environment and so in everything it starts (`trial_processes`)."""
_NUMERICS_TIMEOUT_S = 600.0
_DEVICE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class TrialResult:
    """What one trial measured, or why it measured nothing."""

    outcome: Outcome
    peak_bytes: int | None = None
    """Peak device memory over every step, warm-up included (a real job goes through those too)."""
    step_time_s: float | None = None
    """Median wall-clock seconds of the measured steps (warm-up excluded)."""
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    """``None`` when the batch holds no token ids."""
    throughput: float | None = None
    """`tokens_per_s` when the batch has tokens, else `samples_per_s`: the search's objective."""
    throughput_unit: str = "samples/s"
    step_times_s: tuple[float, ...] = ()
    """Every measured step's seconds, in order."""
    wall_s: float = 0.0
    """Seconds the whole subprocess took, startup included."""
    compile_s: float | None = None
    """Seconds torch.compile spent on the policy's layers (in warm-up); ``None`` when it does not compile."""
    error: str | None = None
    """One line saying what went wrong (``None`` for ``ok``)."""
    stderr_tail: str | None = None
    """The end of the worker's output when it failed or was killed."""
    device: str = ""
    device_total_bytes: int | None = None
    """``None`` on CPU."""
    rank_peak_bytes: tuple[int, ...] = ()
    """Each rank's peak, rank 0 first, in a multi-rank trial (`peak_bytes` is their maximum)."""
    machine: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The machine while the trial ran (`race.machine.machine_state`)."""
    batches: dict[str, Any] | None = None
    """The scan of the data module's first batches (`tuner._trials.batches.BatchScan`); ``None``: not measured."""

    @property
    def noise(self) -> Spread | None:
        """The spread of the measured step times: how loud the machine was (``None`` without any)."""
        from lightning_recompute.race.stats import spread

        return spread(self.step_times_s) if self.step_times_s else None

    @property
    def measured(self) -> bool:
        """Whether the trial produced memory and speed figures (``ok`` or ``over_budget``)."""
        return self.outcome in ("ok", "over_budget")

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (JSON-ready)."""
        d = dataclasses.asdict(self)
        d["step_times_s"] = list(self.step_times_s)
        d["rank_peak_bytes"] = list(self.rank_peak_bytes)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrialResult:
        """The inverse of `to_dict`; unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise RecomputeError(f"trial result: unknown key(s) {unknown}; valid: {sorted(names)}")
        if data.get("outcome") not in get_args(Outcome):
            raise RecomputeError(
                f"trial result: outcome {data.get('outcome')!r}; valid: {', '.join(get_args(Outcome))}"
            )
        values = dict(data)
        values["step_times_s"] = tuple(values.get("step_times_s", ()))
        values["rank_peak_bytes"] = tuple(int(v) for v in values.get("rank_peak_bytes", ()))
        return cls(**values)

    @classmethod
    def skipped(cls, reason: str, *, device: str = "", device_total_bytes: int | None = None) -> TrialResult:
        """A trial not run, and why (e.g. the planner predicts it far over budget)."""
        return cls(outcome="skipped", error=reason, device=device, device_total_bytes=device_total_bytes)


@dataclass(frozen=True)
class NumericsResult:
    """Whether a policy changes one training step's loss, gradients or module state."""

    equal: bool
    """Equal to training without recomputation: bitwise, or within the spread of two runs without it."""
    max_abs_diff: float
    """The largest absolute difference from the run without recomputation."""
    detail: str
    """What was compared (at which micro-batch), or what differed and where."""
    baseline_spread: float = 0.0
    """The largest absolute difference between two runs without recomputation (0.0: reproducible)."""
    micro_batch: int | None = None
    """The micro-batch compared: the requested one, or a smaller one where no recompute fits."""


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
    """Train ``recipe``'s model under ``policy`` for warm-up plus measured steps (default: ``recipe.trial``).

    Never raises for what the trial does: an outcome says it, and a peak above ``budget_bytes`` is
    ``over_budget``. Any exception in the parent while waiting (Ctrl-C) kills the trial and propagates.
    """
    warmup = recipe.trial.warmup_steps if warmup_steps is None else int(warmup_steps)
    measure = recipe.trial.measure_steps if measure_steps is None else int(measure_steps)
    if warmup < 0 or measure < 1:
        raise RecomputeError(f"warmup_steps must be >= 0 and measure_steps >= 1, got {warmup} and {measure}")
    limit = recipe.trial.timeout_s if timeout_s is None else float(timeout_s)
    spec = TrialSpec(
        **_recipe_fields(recipe, micro_batch), policy=policy.to_dict(), warmup_steps=warmup, measure_steps=measure
    )
    run = _run_worker(spec, limit, recipe.trial.env)
    res = run.result
    outcome: Outcome
    if run.timed_out:
        outcome, error = "timeout", f"no result within {limit:g} s; the trial's process group was killed"
    elif res is not None and res.get("outcome") == "ok":
        try:
            return _measured(res, wall_s=run.wall_s, budget_bytes=budget_bytes)
        except (KeyError, TypeError, ValueError) as err:
            outcome, error = "error", f"malformed worker result: {err!r}"
    else:
        outcome, error = _classify_failure(run)
    return TrialResult(
        outcome=outcome, wall_s=run.wall_s, error=error, stderr_tail=run.tail, **_device_fields(recipe, res)
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
    """Race ``entrants`` (a policy and its labels) interleaved on one model, in one subprocess.

    How: `lightning_recompute.race.engine`. Equal policies race once, their labels merged; ``references``
    (entrants too) are what the winner's "vs" figures are about; ``layer_names`` give each policy's glyphs;
    an entrant peaking over ``budget_bytes`` is out. ``plan`` defaults to ``recipe.race``, ``timeout_s`` to a
    trial's timeout plus twice the race's time. A worker that fails gives a ``failed`` result, never raises.
    """
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
    if run.timed_out:
        return RaceResult(outcome="failed", reason=f"no result within {limit:g} s; the race's process group was killed")
    res = run.result
    if res is None or res.get("outcome") != "ok":
        outcome, error = _classify_failure(run)
        return RaceResult(outcome="failed", reason=f"the race ended {outcome}: {error}")
    try:
        return RaceResult.from_worker(res, labels, {k: p.to_dict() for k, p in policies.items()})
    except (KeyError, TypeError, ValueError) as err:
        return RaceResult(outcome="failed", reason=f"malformed race result: {err!r}")


def check_numerics(
    recipe: Recipe, policy: RecomputePolicy, *, micro_batch: int | None = None, timeout_s: float | None = None
) -> NumericsResult:
    """Whether ``policy`` leaves one training step's loss, gradients and module state unchanged.

    In a subprocess, in deterministic mode: one step without recompute, with ``policy`` and without
    again, compared bitwise, or off CPU within the two baselines' spread (`tuner._trials.worker._numerics`).
    Where no recompute runs out of memory, the batch is halved down to one sample. A check that cannot
    run is not equal, with the reason. The rules: docs/TUNER.md, "What the gate guarantees".
    """
    limit = _NUMERICS_TIMEOUT_S if timeout_s is None else float(timeout_s)
    # cuBLAS reads this when its handle is created, so it must be in the starting environment. Not on the
    # CPU: an environment unlike the trials' would cost the fork server a restart.
    cublas = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if recipe.trainer.accelerator != "cpu" else {}
    env = {**cublas, **recipe.trial.env}
    if recipe.trainer.devices > 1:
        run, skipped = _numerics_on_ranks(recipe, policy, micro_batch, limit, env)
    else:
        run, skipped = _run_worker(_numerics_spec(recipe, policy, micro_batch), limit, env), []
    res = run.result
    if not run.timed_out and res is not None and res.get("outcome") == "ok":
        halved = f" (no recompute ran out of memory at {', '.join(map(str, skipped))})" if skipped else ""
        try:
            got = NumericsPayload.from_dict(res)
        except ProtocolError as err:
            return NumericsResult(equal=False, max_abs_diff=float("inf"), detail=f"malformed numerics result: {err}")
        return NumericsResult(
            equal=got.equal,
            max_abs_diff=got.max_abs_diff,
            detail=got.detail + halved,
            baseline_spread=got.baseline_spread,
            micro_batch=got.micro_batch,
        )
    if run.timed_out:
        why = f"the numerics check did not finish within {limit:g} s"
    else:
        why = f"the numerics check failed ({_classify_failure(run)[1]})"
    tail = _last_lines(run.tail, 5)
    return NumericsResult(equal=False, max_abs_diff=float("inf"), detail=f"{why}{': ' + tail if tail else ''}")


def _numerics_on_ranks(
    recipe: Recipe, policy: RecomputePolicy, micro_batch: int | None, limit: float, env: Mapping[str, str]
) -> tuple[_WorkerRun, list[int]]:
    """The numerics check on N ranks, one launch per micro-batch, halved while a rank runs out of memory.

    Halved here, not in the worker: one rank's out-of-memory error ends every rank. Returns the last
    run and the sizes that did not fit.
    """
    from tuner.recipe._build import data_batch_size

    end = time.monotonic() + limit
    size = micro_batch
    skipped: list[int] = []
    while True:
        run = _run_worker(_numerics_spec(recipe, policy, size), max(1.0, end - time.monotonic()), env)
        res = run.result
        current = size if size is not None else data_batch_size(recipe)
        if run.timed_out or res is None or res.get("outcome") != "oom" or current is None or current <= 1:
            return run, skipped
        skipped.append(current)
        size = current // 2


def profile_recipe(recipe: Recipe, micro_batch: int | None = None, *, repeats: int = 3) -> Profile:
    """The per-layer cost profile of ``recipe``'s model on its device.

    On CPU it runs here; on an accelerator in the worker (deadline twice a trial's): a CUDA context in
    the tuning process would hold device memory that every trial then lacks.

    Raises:
        RecomputeError: the profile could not be taken (the message says why).
    """
    from lightning_recompute.profile import Profile

    if recipe.trainer.accelerator == "cpu":
        from lightning_recompute.meter import CPU_MEMORY_LIMIT
        from tuner.recipe._profile import profile_recipe_here

        # On the device a worker would see: the recipe's cap on the CPU.
        cap = recipe.trial.env.get(CPU_MEMORY_LIMIT)
        before = os.environ.get(CPU_MEMORY_LIMIT)
        if cap is not None:
            os.environ[CPU_MEMORY_LIMIT] = cap
        try:
            return profile_recipe_here(recipe, micro_batch, repeats)
        finally:
            if cap is not None:
                if before is None:
                    os.environ.pop(CPU_MEMORY_LIMIT, None)
                else:
                    os.environ[CPU_MEMORY_LIMIT] = before
    limit = recipe.trial.timeout_s * 2
    run = _run_worker(ProfileSpec(**_recipe_fields(recipe, micro_batch), repeats=repeats), limit, recipe.trial.env)
    res = run.result
    if run.timed_out:
        raise RecomputeError(f"profiling did not finish within {limit:g} s; its process group was killed")
    if res is None or res.get("outcome") != "ok":
        why = (res or {}).get("error") or _classify_failure(run)[1]
        raise RecomputeError(f"profiling failed: {why}")
    return Profile.from_dict(res["profile"])


def device_info(recipe: Recipe) -> tuple[str, int | None]:
    """The device a trial of ``recipe`` runs on: ``("cpu", None)`` or ``(name, total bytes)``.

    CUDA is queried in a subprocess, once per accelerator setting, so that the tuning process holds no
    CUDA context.

    Raises:
        RecomputeError: the accelerator names a device this machine cannot use.
    """
    if recipe.trainer.accelerator == "cpu":
        return "cpu", None
    return _probe_device(recipe.trainer.accelerator)


@functools.cache
def _probe_device(accelerator: str) -> tuple[str, int | None]:
    run = _run_worker(DeviceSpec(accelerator=accelerator), _DEVICE_TIMEOUT_S)
    res = run.result
    if run.timed_out or res is None or res.get("outcome") != "ok":
        why = (res or {}).get("error") or _last_lines(run.tail, 3) or "no result"
        raise RecomputeError(f"trainer.accelerator: cannot query the {accelerator!r} device: {why}")
    return str(res["device"]), res.get("device_total_bytes")


def _recipe_fields(recipe: Recipe, micro_batch: int | None) -> dict[str, Any]:
    """The fields every spec about ``recipe`` carries."""
    return {
        "recipe": recipe.to_dict(),
        "source": None if recipe.source is None else str(recipe.source),
        "micro_batch": micro_batch,
        "sys_path": (os.getcwd(), str(recipe.folder)),
    }


def _numerics_spec(recipe: Recipe, policy: RecomputePolicy, micro_batch: int | None) -> NumericsSpec:
    return NumericsSpec(**_recipe_fields(recipe, micro_batch), policy=policy.to_dict())


@dataclass(frozen=True)
class _WorkerRun:
    returncode: int | None
    result: dict[str, Any] | None
    tail: str
    wall_s: float
    timed_out: bool
    oom: OomEvidence | None = None
    """For a worker killed by SIGKILL (not at its deadline): what the kernel says about out-of-memory kills."""


def _run_worker(spec: Spec, timeout_s: float, env: Mapping[str, str] | None = None) -> _WorkerRun:
    """Run the worker on ``spec`` with a deadline; kill its whole process group at the deadline."""
    with tempfile.TemporaryDirectory(prefix=_DIR_PREFIX) as tmp:
        folder = Path(tmp)
        spec_path, result_path, log_path = folder / "spec.json", folder / "result.json", folder / "output.log"
        # Whose folder this is: once this owner is dead, the next run here removes it (`clean_stale_trial_dirs`).
        (folder / _OWNER_FILE).write_text(json.dumps(Owner.me().to_dict()), encoding="utf-8")
        base_env = _worker_env(env or {})
        fork = _forkable(spec)
        if fork:
            # Started (on first use) before the clock and the deadline: the server's imports are not the trial's.
            forkserver.warm(base_env, os.getcwd())
        start = time.monotonic()
        spec = spec.model_copy(update={"deadline": time.time() + timeout_s})
        spec_path.write_text(json.dumps(spec.to_dict()), encoding="utf-8")
        kills_before = oom_kill_count()
        proc = _start_worker([str(spec_path), str(result_path)], log_path, base_env, folder, fork=fork)
        timed_out = False
        try:
            kill_point("trial" if spec.kind == "trial" else "")  # a test hook; see tuner._liveness
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            # Also reaps anything the worker left behind (data-loader workers, compile helpers).
            _kill_group(proc)
        wall = time.monotonic() - start
        if spec.ranks == 1:
            result = _read_result(result_path)
        else:
            paths = [rank_result_path(result_path, r) for r in range(spec.ranks)]
            result = merge_ranks(spec.kind, [_read_result(p) for p in paths])
        killed = not timed_out and proc.returncode == -signal.SIGKILL
        return _WorkerRun(
            returncode=proc.returncode,
            result=result,
            tail=_tail(log_path),
            wall_s=wall,
            timed_out=timed_out,
            oom=oom_evidence(proc.pid, kills_before) if killed else None,
        )


def _start_worker(
    argv: Sequence[str], log_path: Path, base_env: Mapping[str, str], folder: Path, *, fork: bool
) -> subprocess.Popen[bytes] | Forked:
    """Start the worker on ``argv``: forked from the fork server if ``fork`` and it can, else a fresh interpreter.

    Its pid and how it started go to the trial folder, for `trial_processes` to find what it leaves running.
    """
    env = {**base_env, TRIAL_DIR_ENV: str(folder), PARENT_PID_ENV: str(os.getpid())}
    proc: subprocess.Popen[bytes] | Forked | None = None
    if fork:
        proc = forkserver.fork(base_env, os.getcwd(), argv, env, str(log_path), parent_env=PARENT_PID_ENV)
    if proc is None:
        with open(log_path, "wb") as log:
            # Output goes to a file, not a pipe: a child blocked on a full pipe would look hung.
            proc = subprocess.Popen(
                [sys.executable, "-m", "tuner._trials.worker", *argv],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: one killpg ends it and its children
                env=env,
            )
    try:
        record = {"pid": proc.pid, "forked": isinstance(proc, Forked)}
        (folder / _WORKER_FILE).write_text(json.dumps(record), encoding="utf-8")
    except BaseException:
        _kill_group(proc)
        raise
    return proc


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
    """One result from the per-rank results of a multi-rank run (``None``: a rank missing, no failure said why).

    A rank out of memory makes the run ``oom`` (others killed waiting for it wrote nothing), another
    failure ``error``, naming the rank. A trial's steps merge step by step: the slowest rank's time,
    the highest peak, the sum of samples and tokens (throughput is global), and each rank's peak
    (``rank_peak_bytes``). A numerics check is equal only if it is on every rank.
    """
    failed = [(r, rep) for r, rep in enumerate(reports) if rep is not None and rep.get("outcome") != "ok"]
    if failed:
        rank, rep = next(((r, f) for r, f in failed if f.get("outcome") == "oom"), failed[0])
        error = f"rank {rank} of {len(reports)}: {rep.get('error') or 'failed'}"
        return {**rep, "outcome": rep.get("outcome", "error"), "error": error}
    if any(rep is None for rep in reports):
        return None
    done = [dict(rep) for rep in reports if rep is not None]
    if kind == "trial":
        return {**done[0], **_merge_steps([rep["steps"] for rep in done])}
    if kind == "numerics":
        unequal = [f"rank {r}: {rep['detail']}" for r, rep in enumerate(done) if not rep["equal"]]
        return {
            **done[0],
            "equal": not unequal,
            "max_abs_diff": max(float(rep["max_abs_diff"]) for rep in done),
            "baseline_spread": max(float(rep.get("baseline_spread", 0.0)) for rep in done),
            "detail": "; ".join(unequal) if unequal else f"{done[0]['detail']}, and on every rank of {len(done)}",
        }
    raise RecomputeError(f"merging ranks: unknown spec kind {kind!r}; valid: {', '.join(RANKED_KINDS)}")


def _merge_steps(per_rank: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    steps = []
    for column in zip(*per_rank, strict=False):  # a rank with fewer records: the shortest decides
        peaks = [int(s["peak_bytes"]) for s in column if s.get("peak_bytes") is not None]
        tokens = [s.get("tokens") for s in column]
        steps.append(
            {
                "seconds": max(float(s["seconds"]) for s in column),
                "peak_bytes": max(peaks) if peaks else None,
                "samples": sum(int(s["samples"]) for s in column),
                "tokens": None if any(t is None for t in tokens) else sum(int(t) for t in tokens if t is not None),
            }
        )
    rank_peaks = [[int(s["peak_bytes"]) for s in steps if s.get("peak_bytes") is not None] for steps in per_rank]
    return {"steps": steps, "rank_peak_bytes": [max(p) for p in rank_peaks] if all(rank_peaks) else []}


def clean_stale_trial_dirs(tmp_root: str | Path | None = None) -> list[Path]:
    """Remove the trial folders of dead owners on this host, ending what their workers left; the folders removed.

    A SIGKILLed tuning process cannot remove its own. Only a folder whose recorded owner ran on this host
    and is gone is touched, never one without an owner record (it may be being created).
    """
    root = Path(tmp_root) if tmp_root is not None else Path(tempfile.gettempdir())
    removed = []
    for folder in sorted(root.glob(f"{_DIR_PREFIX}*")):
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
    """The processes still running for the trial folder ``folder`` (read from ``/proc``; elsewhere none).

    A fresh worker and what it started have the folder in their environment. A forked worker's ``/proc``
    environment is the fork server's: those are the processes in the session the folder records whose
    server parent is the folder's owner (both, so that a reused pid alone names nobody).
    """
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
    """The processes whose ``/proc`` entry ``matches`` (none where it is unreadable)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            if matches(entry):
                pids.append(int(entry.name))
    return pids


def _pids_in_session(session: int) -> list[int]:
    def in_session(entry: Path) -> bool:
        stat = (entry / "stat").read_text(encoding="utf-8", errors="replace")
        # "pid (comm) state ppid pgrp session ...": the command may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        return len(fields) > 3 and fields[3] == str(session)

    return _pids(in_session)


def _pids_with_env(name: str, value: str) -> list[int]:
    """Processes of this user whose environment sets ``name=value``."""
    needle = f"{name}={value}".encode()
    return _pids(lambda entry: needle in (entry / "environ").read_bytes().split(b"\0"))


def _worker_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {**os.environ, **extra}
    # The folder holding the `tuner` package, so `-m tuner._trials.worker` imports this very tuner.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"  # a killed worker's last words reach the log
    env["PYTHONFAULTHANDLER"] = "1"  # a segfault or abort() leaves a Python traceback in the log
    return env


def _kill_group(proc: subprocess.Popen[bytes] | Forked) -> None:
    if isinstance(proc, Forked):
        proc.kill_group()
    else:
        forkserver.kill_group(proc.pid)
    proc.wait()


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 4 * _TAIL_CHARS))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    # faulthandler ends a crash report with a line listing ~100 C extension modules: it would push the
    # traceback out of the tail.
    lines = [line for line in text.splitlines() if not line.startswith("Extension modules:")]
    return "\n".join(lines)[-_TAIL_CHARS:]


def _last_lines(text: str, n: int) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-n:] if line.strip())


def _classify_failure(run: _WorkerRun) -> tuple[Outcome, str]:
    """``(outcome, one-line error)`` for a worker that produced no measurement."""
    res = run.result
    if res is not None and res.get("outcome") in ("oom", "error", "nonfinite"):
        return res["outcome"], str(res.get("error") or "the worker reported an error")
    if any(marker in run.tail for marker in OOM_MARKERS):
        return "oom", "out of memory (the worker died before writing a result)"
    code = run.returncode
    if code is not None and code < 0:
        try:
            sig = signal.Signals(-code).name
        except ValueError:
            sig = f"signal {-code}"
        if -code == signal.SIGKILL:
            # Not ours (a timeout is handled before this). The kernel's out-of-memory killer sends it, but so
            # do `kill -9`, schedulers and container runtimes: oom only where the kernel records it.
            evidence = run.oom
            if evidence is not None and evidence.found is not None:
                return "oom", f"the worker was killed by signal {-code} ({sig}) for out of memory: {evidence.found}"
            looked = f"; {evidence.looked}" if evidence is not None else ""
            return "error", f"the worker was killed by signal {-code} ({sig}) from outside the tuner{looked}"
        return "error", f"the worker was killed by {sig}: {_crash_summary(run.tail)}"
    return "error", f"the worker exited with status {code} without a result: {_last_lines(run.tail, 1) or 'no output'}"


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
    """Peak memory and median speed from per-step records ``{seconds, peak_bytes, samples, tokens}``.

    Warm-up steps count for memory (a real job runs them too) but not for time (one-off costs). Where
    some steps after the warm-up ran without the memory meter (``peak_bytes`` None: the CPU worker),
    only those are timed, so that the meter's own cost is no part of the figure.

    Raises:
        ValueError: no step after the warm-up.
    """
    measured = list(steps[warmup_steps:])
    if not measured:
        raise ValueError(f"{len(steps)} step(s) recorded, none after {warmup_steps} warm-up step(s)")
    measured = [s for s in measured if s.get("peak_bytes") is None] or measured
    times = [float(s["seconds"]) for s in measured]
    step_time = statistics.median(times)
    peaks = [int(s["peak_bytes"]) for s in steps if s.get("peak_bytes") is not None]
    samples = statistics.median(int(s["samples"]) for s in measured)
    tokens_seen = [int(s["tokens"]) for s in measured if s.get("tokens") is not None]
    samples_per_s = samples / step_time if step_time > 0 else None
    tokens_per_s = None
    if len(tokens_seen) == len(measured) and step_time > 0:
        tokens_per_s = statistics.median(tokens_seen) / step_time
    return {
        "peak_bytes": max(peaks) if peaks else None,
        "step_time_s": step_time,
        "samples_per_s": samples_per_s,
        "tokens_per_s": tokens_per_s,
        "throughput": tokens_per_s if tokens_per_s is not None else samples_per_s,
        "throughput_unit": "tokens/s" if tokens_per_s is not None else "samples/s",
        "step_times_s": tuple(times),
    }


def _device_fields(recipe: Recipe, res: Mapping[str, Any] | None) -> dict[str, Any]:
    if res is not None and "device" in res:
        return {"device": str(res["device"]), "device_total_bytes": res.get("device_total_bytes")}
    # Unknown off the CPU: probing now would cost a subprocess.
    return {"device": "cpu" if recipe.trainer.accelerator == "cpu" else "", "device_total_bytes": None}
