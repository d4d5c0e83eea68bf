"""One command that checks every CUDA path of the plugin and the tuner (issue 25), in at most ten minutes.

No line of the product had run on CUDA when this was written: every figure in docs/BENCHMARKS.md
is from a CPU. When a GPU is lent (minutes, one device, no internet), this is the one command to
run; it prints the device, driver, torch and CUDA versions first and each check's time as it goes,
so a run cut short still says what worked. Each check is isolated: one that fails, raises or runs
out of memory is reported and the next one runs. It ends with one table (also written as JSON with
``--json PATH``) and exits 1 if any check did not pass.

    python bench/gpu_acceptance.py [--json results.json] [--only meter,numerics] [--skip session]
    python bench/gpu_acceptance.py --device cpu      # the dry run: tiny sizes, the paths that exist on CPU

The checks (tolerances are the issue's):

1. ``meter``: the callback's peak of a training step (`lightning_recompute.probe.step_peak`, read by
   `CudaMemoryMeter`) against ``torch.cuda.max_memory_allocated`` around the same step written by
   hand, for none / selective / full / offload / a mixed policy on a model of a few hundred MB:
   within 0.5%. On CPU the hand-written step is read by the storage ledger instead.
2. ``numerics``: every mode (and a mixed policy) with SDPA on its default backends, in bf16-mixed
   (flash kernels) and fp32 (memory-efficient ones) on CUDA, through the trial worker's own numerics
   check (the gate's rule, run in this process): bitwise where the kernels are deterministic, else
   within the spread of two runs without recompute; both spreads are printed.
3. ``offload``: offloading the first half of the layers lowers the step's peak by the bytes those
   layers' saved activations occupy on the device (counted with saved-tensor hooks, as the plugin's
   offload selects them), within 5% of those bytes; tokens/s of none and offload; the callback's
   step time (`StepTimer`) is at least the CUDA events' time of the same steps (it synchronises).
   On CPU the plugin runs offload as none, so the expected drop is zero.
4. ``session``: ``python -m tuner RECIPE --format json`` on a small recipe in a temporary folder
   (sqlite stores), budget set between full's and none's predicted peaks so recomputation is
   needed; it must promote. The promoted policy, its figures and every speed figure the summary
   has (`SESSION_FIGURE_KEYS`) are reported.
5. ``planner``: a model sized from the device's memory so that keeping every activation does not
   fit; the planner's policy for 85% of the memory (profiled on the meta device, as ``plan --meta``
   does) and ``full`` are measured: predicted peak within 3% of the measured one.
6. ``compile``: a compiled policy (``compile: true``) with ``full`` against the same compiled model
   with ``none``: the step's peak as the CUDA allocator sees it (Inductor's buffers included) is
   lower with recomputation, and the weights after three SGD steps are equal (bitwise, or within
   the plugin's compiled tolerance). The CPU dry run compiles with ``aot_eager`` (Inductor costs about a
   minute per graph on CPU), and its peak is an eager step's: the CPU ledger runs compiled layers
   eagerly, as it cannot see compiled code.
7. ``in_job``: `lightning_recompute.auto.AutoRecompute` in a training job on a device capped between ``full``'s
   and ``none``'s peaks (on CUDA a per-process memory fraction, on the CPU ``RECOMPUTE_CPU_MEMORY_LIMIT``),
   so ``none`` runs out of memory for real. Racing ``full`` and ``none``: ``none`` must be out of the
   race, its step run again under ``full``, ``full`` chosen. With no candidates given: the first-batch
   profile must profile ``none`` from what fits and the planner's choice train on. Both runs' weights
   after 30 steps equal a plain run's (bitwise, or within 1e-4 where CUDA kernels are not deterministic).

Not checked here: several GPUs (DDP, FSDP, recipes/llama-8gpu-fsdp.yaml) and the 1B recipe's own
session, which would not fit the ten minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `python bench/gpu_acceptance.py` imports this checkout's packages

import lightning as L  # noqa: E402 - after the path above
import torch  # noqa: E402
from torch import nn  # noqa: E402

from lightning_recompute import QUIET_TRAINER, RecomputeCallback, RecomputePolicy, apply_policy  # noqa: E402
from lightning_recompute.apply import COMPILED_ATOL, COMPILED_RTOL  # noqa: E402
from lightning_recompute.meter import StorageMeter  # noqa: E402
from lightning_recompute.planner import Planner  # noqa: E402
from lightning_recompute.probe import step_peak  # noqa: E402
from lightning_recompute.profile import ALL_MODES, profile_meta  # noqa: E402
from lightning_recompute.reference import ReferenceGPT, SyntheticTokens  # noqa: E402
from lightning_recompute.units import format_bytes  # noqa: E402
from tuner._trials.oom import is_oom_error  # noqa: E402

METER_TOLERANCE = 0.005
OFFLOAD_TOLERANCE = 0.05
PLANNER_TOLERANCE = 0.03
PLANNER_BUDGET_FRACTION = 0.85
"""Check 5's budget: the recipes' ``90%`` less a 5% margin, as gpt-1b-h100.yaml asks."""
SESSION_FIGURE_KEYS = ("best", "gains", "vs")
"""Top-level keys of the tuner's JSON summary whose speed and uncertainty figures check 4 reports:
the chosen trial and the race's "vs" figures with their intervals (``race`` itself, every entrant's
per-round times, stays in the JSON file)."""
CHECK_NAMES = ("meter", "numerics", "offload", "session", "planner", "compile", "in_job")


# ---------------------------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class Sizes:
    """Every size the checks use on one kind of device."""

    model: dict[str, Any]
    """`ReferenceGPT` arguments of checks 1 and 3 (a few hundred MB of weights on CUDA)."""
    batch: int
    timed_steps: int
    """Check 3's timed steps per policy (after two warm-up steps)."""
    numerics_model: dict[str, Any]
    numerics_batch: int
    numerics_precisions: tuple[str, ...]
    session_model: dict[str, Any]
    session_batch: int
    session_trials: int
    session_timeout_s: float
    session_race: dict[str, Any]
    """The session recipe's ``race`` section: short, so the check fits its time (the race's statistics are
    tested elsewhere; here it must run on the device and give figures)."""
    plan_model: dict[str, Any]
    plan_dtype: torch.dtype
    card_bytes: int | None
    """Check 5's device memory; ``None``: the device's own (a CPU has none, so the dry run pretends)."""
    compile_model: dict[str, Any]
    compile_batch: int
    compile_backend: str | None
    """``None``: torch.compile's default (Inductor)."""


def _gpt(vocab: int, seq: int, layers: int, width: int, heads: int, dropout: float) -> dict[str, Any]:
    return {
        "vocab_size": vocab,
        "seq_len": seq,
        "n_layer": layers,
        "n_embd": width,
        "n_head": heads,
        "dropout": dropout,
        "attention": "sdpa",
    }


CUDA_SIZES = Sizes(
    # 136M parameters (544 MB in fp32); a step peaks near 9 GB with every activation kept.
    model=_gpt(16384, 1024, 8, 1024, 16, 0.1),
    batch=8,
    timed_steps=6,
    numerics_model=_gpt(8192, 512, 4, 512, 8, 0.1),
    numerics_batch=8,
    # bf16-mixed, what the GPU recipes train in, runs SDPA's flash kernels; fp32 its memory-efficient ones.
    numerics_precisions=("bf16-mixed", "32-true"),
    session_model=_gpt(8192, 512, 4, 512, 8, 0.1),
    session_batch=8,
    session_trials=4,
    session_timeout_s=330.0,
    session_race={"max_rounds": 16, "estimate_rounds": 10, "time_s": 45.0},
    # ~0.94B parameters in bf16; about 2.6 GB of activations per sample with every one kept.
    plan_model=_gpt(32768, 2048, 16, 2048, 16, 0.0),
    plan_dtype=torch.bfloat16,
    card_bytes=None,
    compile_model=_gpt(8192, 512, 4, 512, 8, 0.0),
    compile_batch=8,
    compile_backend=None,
)

CPU_SIZES = Sizes(
    model=_gpt(128, 32, 4, 32, 4, 0.1),
    batch=4,
    timed_steps=2,
    numerics_model=_gpt(128, 32, 2, 32, 4, 0.1),
    numerics_batch=2,
    numerics_precisions=("32-true",),
    session_model=_gpt(128, 32, 4, 32, 4, 0.1),
    session_batch=4,
    session_trials=3,
    session_timeout_s=400.0,  # ~60 s on an idle 2-core machine; the limit is for a hang, not for a busy machine
    session_race={"min_rounds": 4, "max_rounds": 8, "estimate_rounds": 6, "time_s": 20.0},
    plan_model=_gpt(128, 64, 3, 32, 4, 0.0),
    plan_dtype=torch.float32,
    card_bytes=4 * 2**20,
    compile_model=_gpt(64, 16, 2, 16, 2, 0.0),
    compile_batch=2,
    compile_backend="aot_eager",
)


# ---------------------------------------------------------------------------------------------- results


@dataclass
class CheckResult:
    """One check's verdict and the figures it rests on."""

    name: str
    status: str
    """``pass``, ``fail``, ``error`` (it raised), ``oom`` (it ran out of memory) or ``skipped``."""
    seconds: float
    summary: str
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    passed: bool
    summary: str
    figures: dict[str, Any]


@dataclass
class Context:
    """What every check gets: the device, its sizes, a scratch folder and the printer."""

    device: torch.device
    sizes: Sizes
    scratch: Path
    say: Callable[[str], None]
    child_env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    """The environment a child process gets: this process's as it started, before `main` set anything."""

    @property
    def accelerator(self) -> str:
        return self.device.type

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


Check = Callable[[Context], Verdict]


# ---------------------------------------------------------------------------------------------- helpers


def _model(cfg: Mapping[str, Any], seed: int = 0, cls: type[ReferenceGPT] = ReferenceGPT) -> ReferenceGPT:
    torch.manual_seed(seed)
    return cls(**cfg)


def _data(cfg: Mapping[str, Any], batch: int, num_batches: int = 16) -> SyntheticTokens:
    return SyntheticTokens(
        vocab_size=cfg["vocab_size"], seq_len=cfg["seq_len"], batch_size=batch, num_batches=num_batches
    )


def _layer_names(cfg: Mapping[str, Any]) -> list[str]:
    return [f"blocks.{i}" for i in range(cfg["n_layer"])]


def _mixed(names: Sequence[str]) -> RecomputePolicy:
    """Every mode at least once when there are four layers or more: full, selective, offload, none, ..."""
    cycle = ("full", "selective", "offload", "none")
    return RecomputePolicy.from_modes({n: cycle[i % len(cycle)] for i, n in enumerate(names)})


def _policies(names: Sequence[str]) -> dict[str, RecomputePolicy]:
    out = {m: RecomputePolicy.uniform(m) for m in ("none", "selective", "full", "offload")}
    out["mixed"] = _mixed(names)
    return out


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        # Offload's "no effect on CPU" notice, Lightning's advice on workers and logging: the checks report.
        warnings.simplefilter("ignore")
        yield


def _release(device: torch.device) -> None:
    """Free what the last model left (cycles through the Trainer included), so the next measurement
    starts from an empty device. Not on CPU: the ledger counts only what it sees allocated and what it
    is given, so garbage left there changes no figure, and a collection costs ~0.4 s with torch loaded."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _reference_peak(model: ReferenceGPT, data: SyntheticTokens, policy: RecomputePolicy, device: torch.device) -> int:
    """The peak of the second training step written by hand, in Lightning's order, with the
    gradients freed at batch start (as the callback does): ``torch.cuda.max_memory_allocated`` on
    CUDA, the storage ledger on CPU. The second step is the first with the optimizer's state."""
    model.to(device).train()
    apply_policy(model, policy)
    optimizer = model.configure_optimizers()
    loader = iter(data.train_dataloader())
    peak = 0
    for step in range(2):
        batch = tuple(t.to(device) for t in next(loader))
        optimizer.zero_grad(set_to_none=True)
        meter: StorageMeter | None = None
        if step == 1:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            else:
                meter = StorageMeter(device)
                meter.track(model, optimizer, batch)
                meter.start()
        loss = model.training_step(batch, 0)
        optimizer.zero_grad(set_to_none=True)  # Lightning's zero_grad between forward and backward
        loss.backward()
        del loss
        optimizer.step()
        if step == 1:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                peak = int(torch.cuda.max_memory_allocated(device))
            elif meter is not None:
                peak = meter.peak_bytes
                meter.close()
    return peak


def _rel(a: float, b: float) -> float:
    return abs(a - b) / b if b else math.inf


# ---------------------------------------------------------------------------------------------- 1. meter


def check_meter(ctx: Context) -> Verdict:
    cfg, names = ctx.sizes.model, _layer_names(ctx.sizes.model)
    reference = "torch.cuda.max_memory_allocated" if ctx.cuda else "the storage ledger"
    rows: dict[str, Any] = {}
    worst = 0.0
    for label, policy in _policies(names).items():
        with _quiet():
            # Gradients freed at batch start, as the hand-written step below does (the callback's own choice here).
            data = _data(cfg, ctx.sizes.batch)
            meter = step_peak(_model(cfg), data, policy, accelerator=ctx.accelerator, free_grads_at_batch_start=True)
            _release(ctx.device)
            ref = _reference_peak(_model(cfg), _data(cfg, ctx.sizes.batch), policy, ctx.device)
            _release(ctx.device)
        err = _rel(meter, ref)
        worst = max(worst, err)
        rows[label] = {"meter_bytes": meter, "reference_bytes": ref, "rel_error": err}
        ctx.say(f"  {label:<10} meter {format_bytes(meter):>11}  {reference} {format_bytes(ref):>11}  {err:.3%}")
    params = sum(p.numel() for p in _model(cfg).parameters())
    return Verdict(
        worst <= METER_TOLERANCE,
        f"worst {worst:.3%} of {reference} over none/selective/full/offload/mixed (limit {METER_TOLERANCE:.1%}); "
        f"{params:,} parameters",
        {"reference": reference, "parameters": params, "worst_rel_error": worst, "policies": rows},
    )


# ---------------------------------------------------------------------------------------------- 2. numerics


def _recipe_dict(
    model: Mapping[str, Any], batch: int, accelerator: str, precision: str, **extra: Any
) -> dict[str, Any]:
    return {
        "name": extra.pop("name", "gpu-acceptance"),
        "model": {"class_path": "lightning_recompute.reference.ReferenceGPT", "init_args": dict(model)},
        "data": {
            "class_path": "lightning_recompute.reference.SyntheticTokens",
            "init_args": {"vocab_size": model["vocab_size"], "seq_len": model["seq_len"], "batch_size": batch},
        },
        "trainer": {"accelerator": accelerator, "precision": precision},
        "budget": extra.pop("budget", {"value": "1GiB"}),
        **extra,
    }


def _worker_numerics(recipe: Mapping[str, Any], policy: RecomputePolicy, folder: Path) -> dict[str, Any]:
    """The trial worker's ``numerics`` kind (the gate's rule), run in this process by the worker's entry point."""
    from tuner._trials import worker

    spec_path, result_path = folder / "spec.json", folder / "result.json"
    spec: dict[str, Any] = {
        "kind": "numerics",
        "recipe": dict(recipe),
        "source": None,
        "policy": policy.to_dict(),
        "sys_path": [],
    }
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    result_path.unlink(missing_ok=True)
    # The worker records itself as the parent of ranks it might start; this process is no worker.
    saved = os.environ.get("RECOMPUTE_TUNE_PARENT_PID")
    try:
        code = worker.main([str(spec_path), str(result_path)])
    finally:
        if saved is None:
            os.environ.pop("RECOMPUTE_TUNE_PARENT_PID", None)
        else:
            os.environ["RECOMPUTE_TUNE_PARENT_PID"] = saved
    result: dict[str, Any] = json.loads(result_path.read_text(encoding="utf-8"))
    result["exit_code"] = code
    return result


def check_numerics(ctx: Context) -> Verdict:
    sz = ctx.sizes
    names = _layer_names(sz.numerics_model)
    policies = {m: RecomputePolicy.uniform(m) for m in ALL_MODES}
    policies["mixed"] = _mixed(names)
    rows: dict[str, dict[str, Any]] = {}
    failed: list[str] = []
    bitwise = 0
    for precision in sz.numerics_precisions:
        recipe = _recipe_dict(sz.numerics_model, sz.numerics_batch, ctx.accelerator, precision)
        rows[precision] = {}
        for label, policy in policies.items():
            with _quiet():
                res = _worker_numerics(recipe, policy, ctx.scratch)
            _release(ctx.device)
            if res.get("outcome") != "ok":
                # One mode that cannot run (an OOM, an error) is that mode's failure; the others still say theirs.
                rows[precision][label] = {"equal": False, "error": res.get("error"), "outcome": res.get("outcome")}
                failed.append(f"{precision}/{label} ({res.get('outcome')})")
                ctx.say(f"  {precision:<10} {label:<22} {res.get('outcome')}: {res.get('error')}")
                continue
            rows[precision][label] = {k: res.get(k) for k in ("equal", "max_abs_diff", "baseline_spread", "detail")}
            bitwise += res["max_abs_diff"] == 0.0
            if not res["equal"]:
                failed.append(f"{precision}/{label}")
            ctx.say(
                f"  {precision:<10} {label:<22} {'equal' if res['equal'] else 'DIFFERENT':<9} policy vs no recompute "
                f"{res['max_abs_diff']:.3g}, no recompute vs itself {res['baseline_spread']:.3g}"
            )
    total = len(policies) * len(sz.numerics_precisions)
    summary = (
        f"{total - len(failed)}/{total} mode runs equal to no recompute ({bitwise} bitwise), "
        f"{' and '.join(sz.numerics_precisions)}, SDPA default backends"
    )
    if failed:
        summary += f"; not equal: {', '.join(failed)}"
    return Verdict(not failed, summary, {"precisions": rows})


# ---------------------------------------------------------------------------------------------- 3. offload


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the device bytes the plugin's offload would move out of the layer: saved tensors on the
    device that are not the layer's parameters (`lightning_recompute.apply._OffloadActivations`'s
    rule), each storage once (views of one storage free it once)."""

    def __init__(self, module: nn.Module, device_type: str, seen: dict[int, int]) -> None:
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if t.device.type == device_type and storage.data_ptr() not in params:
                seen[storage.data_ptr()] = int(storage.nbytes())
            return t

        super().__init__(pack, lambda t: t)


def _offloadable_bytes(cfg: Mapping[str, Any], batch: int, layers: Sequence[str], device: torch.device) -> int:
    """Device bytes of what ``layers`` save for backward in one training forward without recompute."""
    model = _model(cfg).to(device).train()
    x, y = (t.to(device) for t in next(iter(_data(cfg, batch).train_dataloader())))
    seen: dict[int, int] = {}
    contexts: dict[str, _SavedBytes] = {}
    handles = []
    for name in layers:
        module = model.get_submodule(name)

        def enter(mod: nn.Module, args: Any, name: str = name) -> None:
            contexts[name] = _SavedBytes(mod, device.type, seen)
            contexts[name].__enter__()

        def leave(mod: nn.Module, args: Any, out: Any, name: str = name) -> None:
            contexts.pop(name).__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    loss = model.loss((x, y))
    for h in handles:
        h.remove()
    del loss, model
    return sum(seen.values())


class _DeviceTimes:
    """Each training batch's time by CUDA events (perf_counter on CPU), inside the callback's `StepTimer` interval.

    Two Lightning callbacks around `RecomputeCallback` (hooks run in list order): `before` records
    the end of a batch before the timer stops, `after` the start after the timer starts. So the
    events lie within the timer's interval, and the timer, which synchronises at its stop, can be no
    shorter than the events' time; a timer that did not wait for the device would be. Nothing here
    synchronises during the fit (that would make the timer right whatever it does); the events are
    read after it.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.starts: list[Any] = []
        self.ends: list[Any] = []
        self.before, self.after = (
            _Mark(self.ends.append, self._now, "end"),
            _Mark(self.starts.append, self._now, "start"),
        )

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [start.elapsed_time(end) / 1e3 for start, end in zip(self.starts, self.ends, strict=True)]
        return [end - start for start, end in zip(self.starts, self.ends, strict=True)]


class _Mark(L.Callback):
    def __init__(self, keep: Callable[[Any], None], now: Callable[[], Any], at: str) -> None:
        self.keep, self.now, self.at = keep, now, at

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        if self.at == "start":
            self.keep(self.now())

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if self.at == "end":
            self.keep(self.now())


def _timed_fit(ctx: Context, policy: RecomputePolicy) -> dict[str, float]:
    """Median tokens/s, callback step time and device time over the timed steps (two warm-up steps first)."""
    cfg, warmup = ctx.sizes.model, 2
    steps = warmup + ctx.sizes.timed_steps
    callback = RecomputeCallback(policy, measure_memory=False)
    device_times = _DeviceTimes(ctx.device)
    trainer = L.Trainer(
        accelerator=ctx.accelerator,
        devices=1,
        max_steps=steps,
        callbacks=[device_times.before, callback, device_times.after],
        **QUIET_TRAINER,
    )
    with _quiet():
        trainer.fit(_model(cfg), datamodule=_data(cfg, ctx.sizes.batch))
    records = list(callback.records)[warmup:]
    device_s = device_times.seconds()[warmup:]
    return {
        "tokens_per_s": statistics.median(r.tokens_per_s or 0.0 for r in records),
        "step_timer_s": statistics.median(r.seconds for r in records),
        "device_s": statistics.median(device_s),
    }


def check_offload(ctx: Context) -> Verdict:
    cfg, batch = ctx.sizes.model, ctx.sizes.batch
    names = _layer_names(cfg)
    half = names[: len(names) // 2]
    policy = RecomputePolicy.from_modes({n: ("offload" if n in half else "none") for n in names})
    moved = _offloadable_bytes(cfg, batch, half, ctx.device)
    _release(ctx.device)
    with _quiet():
        peaks = {}
        for label, p in (("none", RecomputePolicy.uniform("none")), ("offload", policy)):
            peaks[label] = step_peak(_model(cfg), _data(cfg, batch), p, accelerator=ctx.accelerator)
            _release(ctx.device)
    drop = peaks["none"] - peaks["offload"]
    # The plugin offloads only from CUDA; on CPU its offload layers run as none (README), so nothing drops.
    expected = moved if ctx.cuda else 0
    off_by = abs(drop - expected) / moved if moved else math.inf
    ctx.say(
        f"  offloading {len(half)} of {len(names)} layers: saved activations {format_bytes(moved)}, peak "
        f"{format_bytes(peaks['none'])} -> {format_bytes(peaks['offload'])} (drop {format_bytes(drop)}, "
        f"expected {format_bytes(expected)})"
    )
    speed = {}
    for label, p in (("none", RecomputePolicy.uniform("none")), ("offload", policy)):
        speed[label] = _timed_fit(ctx, p)
        _release(ctx.device)
        s = speed[label]
        ctx.say(
            f"  {label:<8} {s['tokens_per_s']:,.0f} tokens/s; step {s['step_timer_s'] * 1e3:.2f} ms by StepTimer, "
            f"{s['device_s'] * 1e3:.2f} ms by {'CUDA events' if ctx.cuda else 'perf_counter'}"
        )
    # The timer brackets the events: shorter than they are means it did not wait for the device. The
    # 0.1% allows for the GPU's and the host's clocks measuring the same interval a little differently.
    timer_ok = all(s["step_timer_s"] >= 0.999 * s["device_s"] for s in speed.values())
    ratio = speed["offload"]["tokens_per_s"] / speed["none"]["tokens_per_s"]
    passed = off_by <= OFFLOAD_TOLERANCE and timer_ok
    summary = (
        f"peak drop {format_bytes(drop)} vs {'offloaded' if ctx.cuda else 'expected (CPU: none)'} "
        f"{format_bytes(expected)}: off by {off_by:.2%} of {format_bytes(moved)} (limit {OFFLOAD_TOLERANCE:.0%}); "
        f"{speed['offload']['tokens_per_s']:,.0f} vs {speed['none']['tokens_per_s']:,.0f} tokens/s "
        f"({ratio:.2f}x); StepTimer {'>=' if timer_ok else '<'} device time"
    )
    return Verdict(
        passed,
        summary,
        {
            "layers_offloaded": half,
            "offloadable_bytes": moved,
            "expected_drop_bytes": expected,
            "peaks": peaks,
            "drop_bytes": drop,
            "off_by_fraction_of_offloadable": off_by,
            "speed": speed,
            "step_timer_covers_device_time": timer_ok,
        },
    )


# ---------------------------------------------------------------------------------------------- 4. session


def _session_budget(recipe: Any) -> tuple[int, int, int]:
    """A budget limit between full's and none's predicted peaks (60% of the way up): ``(limit, full, none)``."""
    from tuner.recipe._profile import profile_recipe_meta

    planner = Planner(profile_recipe_meta(recipe, None, "H100"))
    full = planner.predict(RecomputePolicy.uniform("full")).peak_bytes
    none = planner.predict(RecomputePolicy.uniform("none")).peak_bytes
    return int(full + 0.6 * (none - full)), full, none


_NOT_FIGURES = frozenset({"number", "policy", "seed", "duplicate_of", "micro_batch", "round"})
"""Numbers in the summary that are identifiers, not measurements."""


def _figures(value: Any, prefix: str = "") -> dict[str, float]:
    """Every measured number in ``value``, flattened as ``a.b.c``: whatever speed and uncertainty figures it holds."""
    out: dict[str, float] = {}
    if isinstance(value, Mapping):
        for k, v in value.items():
            if k in _NOT_FIGURES:
                continue
            out.update(_figures(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out[prefix] = value
    return out


def check_session(ctx: Context) -> Verdict:
    folder, limit = _session_recipe(ctx)
    path = os.pathsep.join(p for p in (str(REPO), ctx.child_env.get("PYTHONPATH")) if p)
    # The session's race, shortened to the check's minutes (RECOMPUTE_TUNE_RACE_PLAN: `RacePlan` fields).
    env = {**ctx.child_env, "PYTHONPATH": path, "RECOMPUTE_TUNE_RACE_PLAN": json.dumps(ctx.sizes.session_race)}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "tuner", "recipe.yaml", "--format", "json"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=ctx.sizes.session_timeout_s,
        check=False,
    )
    wall = time.perf_counter() - started
    try:
        summary = json.loads(proc.stdout)
    except json.JSONDecodeError:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"the session exited {proc.returncode} without a JSON summary:\n{tail}") from None
    best = summary.get("best") or {}
    promoted = summary.get("status") == "promoted" and proc.returncode == 0
    written = None
    if summary.get("policy_path") and Path(summary["policy_path"]).exists():
        written = RecomputePolicy.load(summary["policy_path"]).fingerprint()
    candidate = (summary.get("evidence") or {}).get("candidate", {}).get("fingerprint")
    figures = _session_figures(ctx, summary, proc.returncode, wall, candidate, written)
    passed = promoted and written is not None and written == candidate
    peak, used = best.get("peak_bytes"), summary.get("budget_bytes")
    verdict = (
        f"{summary.get('status')} {best.get('policy_short')} ({candidate}), exit {proc.returncode}, "
        f"peak {format_bytes(peak) if peak is not None else '?'} (limit {format_bytes(used or limit)}), "
        f"{best.get('throughput') or 0:,.0f} {best.get('throughput_unit', '')}, session {wall:.0f} s"
    )
    if written is not None and written != candidate:
        verdict += f"; the policy file holds {written}, not the promoted {candidate}"
    return Verdict(passed, verdict, figures)


def _session_recipe(ctx: Context) -> tuple[Path, int]:
    """The session check's recipe, written to a fresh folder, with a budget between the predicted peaks of
    full and none; the folder and the limit."""
    import yaml

    from tuner.recipe import from_dict

    sz = ctx.sizes
    folder = Path(tempfile.mkdtemp(prefix="session-", dir=ctx.scratch))
    raw = _recipe_dict(
        sz.session_model,
        sz.session_batch,
        ctx.accelerator,
        "32-true",  # the meta-device prediction that sets the budget is of fp32 activations
        name="gpu-acceptance-session",
        search={"modes": ["none", "selective", "full"], "n_trials": sz.session_trials, "seed": 0},
        trial={"warmup_steps": 2, "measure_steps": 3, "timeout_s": 120},
        tracking={"uri": "sqlite:///mlflow.db"},
        study={"storage": "sqlite:///optuna.db"},
        output="policy.yaml",
    )
    limit, full, none = _session_budget(from_dict(raw, source=folder / "recipe.yaml"))
    margin = 0.05
    raw["budget"] = {"value": f"{math.ceil(limit / (1 - margin))}B", "margin": margin}
    (folder / "recipe.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    ctx.say(
        f"  budget limit {format_bytes(limit)} (predicted full {format_bytes(full)}, none {format_bytes(none)}); "
        f"{sz.session_trials} trials in {folder}"
    )
    return folder, limit


def _session_figures(
    ctx: Context, summary: dict[str, Any], exit_code: int, wall: float, candidate: str | None, written: str | None
) -> dict[str, Any]:
    """What the session check records from the session's JSON summary (and says as it goes)."""
    best = summary.get("best") or {}
    figures: dict[str, Any] = {
        "exit_code": exit_code,
        "status": summary.get("status"),
        "wall_s": wall,
        "device": summary.get("device"),
        "budget_bytes": summary.get("budget_bytes"),
        "promoted_policy": best.get("policy_short"),
        "promoted_fingerprint": candidate,
        "policy_file_fingerprint": written,
        "peak_bytes": best.get("peak_bytes"),
        "predicted_peak_bytes": best.get("predicted_peak_bytes"),
        "throughput": best.get("throughput"),
        "throughput_unit": best.get("throughput_unit"),
        "reasons": summary.get("reasons"),
    }
    for key in SESSION_FIGURE_KEYS:
        found = _figures(summary[key]) if key in summary else None
        figures[f"summary.{key}"] = found
        ctx.say(f"  {key}: " + (", ".join(f"{k}={v:.4g}" for k, v in found.items()) if found else "absent"))
    regression = _figures(((summary.get("evidence") or {}).get("regression")) or {})
    figures["summary.evidence.regression"] = regression
    ctx.say("  gate regression race: " + (", ".join(f"{k}={v:.4g}" for k, v in regression.items()) or "not run"))
    for reason in summary.get("reasons") or []:
        ctx.say(f"  gate: {reason}")
    return figures


# ---------------------------------------------------------------------------------------------- 5. planner


_MAX_PLAN_MICRO_BATCH = 1024


def _plan_profile(ctx: Context, micro_batch: int) -> Any:
    cfg, dtype = ctx.sizes.plan_model, ctx.sizes.plan_dtype
    batch = next(iter(_data(cfg, micro_batch).train_dataloader()))
    return profile_meta(
        lambda: ReferenceGPT(**cfg).to(dtype=dtype), batch, modes=["none", "selective", "full"], hardware="H100"
    )


def plan_micro_batch(one: Planner, card: int) -> int:
    """The smallest micro-batch at which keeping every activation does not fit ``card`` bytes, from a
    profile at one sample (predictions scale with the micro-batch)."""
    none = RecomputePolicy.uniform("none")
    micro_batch = 1
    while one.predict(none, micro_batch=micro_batch).peak_bytes <= card:
        micro_batch += 1
        if micro_batch > _MAX_PLAN_MICRO_BATCH:
            raise RuntimeError(
                f"plan_model: keeping every activation still fits {format_bytes(card)} at micro-batch "
                f"{_MAX_PLAN_MICRO_BATCH}; make the model's activations larger"
            )
    return micro_batch


def check_planner(ctx: Context) -> Verdict:
    cfg, dtype = ctx.sizes.plan_model, ctx.sizes.plan_dtype
    card = ctx.sizes.card_bytes or int(torch.cuda.get_device_properties(ctx.device).total_memory)
    none = RecomputePolicy.uniform("none")
    micro_batch = plan_micro_batch(Planner(_plan_profile(ctx, 1)), card)
    # Then profiled again at that micro-batch, so the compared predictions are exact, not scaled.
    planner = Planner(_plan_profile(ctx, micro_batch))
    budget = int(PLANNER_BUDGET_FRACTION * card)
    plan = planner.solve(budget)
    predicted_none = planner.predict(none).peak_bytes
    ctx.say(
        f"  card {format_bytes(card)}: micro-batch {micro_batch}, none predicted {format_bytes(predicted_none)}; "
        f"planned {plan.short()} for {format_bytes(budget)}"
    )
    rows: dict[str, Any] = {}
    worst = 0.0
    for label, policy in (("planned", plan.policy), ("full", RecomputePolicy.uniform("full"))):
        predicted = planner.predict(policy).peak_bytes
        with _quiet():
            model = _model(cfg).to(dtype=dtype)
            measured = step_peak(model, _data(cfg, micro_batch), policy, accelerator=ctx.accelerator)
            del model
        _release(ctx.device)
        err = _rel(predicted, measured)
        worst = max(worst, err)
        rows[label] = {
            "policy": policy.short(_layer_names(cfg)),
            "predicted_bytes": predicted,
            "measured_bytes": measured,
            "rel_error": err,
        }
        ctx.say(f"  {label:<8} predicted {format_bytes(predicted):>11} measured {format_bytes(measured):>11} {err:.2%}")
    needs = predicted_none > card
    passed = worst <= PLANNER_TOLERANCE and needs
    return Verdict(
        passed,
        f"worst {worst:.2%} predicted vs measured (limit {PLANNER_TOLERANCE:.0%}); micro-batch {micro_batch}, none "
        f"predicted {format_bytes(predicted_none)} > card {format_bytes(card)}; planned {plan.short()}",
        {
            "card_bytes": card,
            "card_is_pretend": ctx.sizes.card_bytes is not None,
            "micro_batch": micro_batch,
            "dtype": str(dtype),
            "budget_bytes": budget,
            "none_predicted_bytes": predicted_none,
            "worst_rel_error": worst,
            "policies": rows,
        },
    )


# ---------------------------------------------------------------------------------------------- 6. compile


class _SGDReferenceGPT(ReferenceGPT):
    """`ReferenceGPT` trained by plain SGD, so weights after a step differ exactly as the gradients do.

    AdamW's first step divides each gradient by its own magnitude: a 1e-9 difference in a gradient
    near zero would move a weight by up to the learning rate, and weights would look unequal when
    the gradients agree to the compiled tolerance.
    """

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@contextlib.contextmanager
def _compile_backend(backend: str | None) -> Iterator[None]:
    """torch.compile with ``backend`` for the plugin's ``compile: true`` (which takes the default, Inductor)."""
    if backend is None:
        yield
        return
    real = torch.compile
    torch.compile = functools.partial(real, backend=backend)
    try:
        yield
    finally:
        torch.compile = real


@dataclass(frozen=True)
class _CompiledRun:
    peak_bytes: int | None
    """The last step's peak: the CUDA allocator's, Inductor's buffers included; on CPU an eager step's."""
    weights: dict[str, torch.Tensor]
    graphs: int
    """Graphs dynamo compiled: a compile check that compiled nothing would prove nothing."""


def _compiled_run(ctx: Context, mode: str, steps: int) -> _CompiledRun:
    """``steps`` steps of the ``mode`` policy with ``compile: true``: the last step's peak, the weights after all."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    cfg = ctx.sizes.compile_model
    torch._dynamo.reset()  # each run compiles its own graphs, as a trial's fresh process does
    counters.clear()
    # On CUDA every step is metered by the allocator and runs compiled. On CPU a metered step runs its
    # compiled layers eagerly (the ledger is a dispatch mode, docs/TUNER.md), so only the last step is metered:
    # the ones before it run compiled.
    metered = None if ctx.cuda else range(steps - 1, steps)
    callback = RecomputeCallback(RecomputePolicy.uniform(mode, compile=True), memory_steps=metered)
    trainer = L.Trainer(accelerator=ctx.accelerator, devices=1, max_steps=steps, callbacks=[callback], **QUIET_TRAINER)
    model = _model(cfg, cls=_SGDReferenceGPT)
    with _quiet(), _compile_backend(ctx.sizes.compile_backend):
        trainer.fit(model, datamodule=_data(cfg, ctx.sizes.compile_batch))
    return _CompiledRun(
        peak_bytes=callback.records[-1].peak_bytes,
        weights={n: p.detach().float().cpu().clone() for n, p in model.named_parameters()},
        graphs=int(counters["stats"]["unique_graphs"]),
    )


def check_compile(ctx: Context) -> Verdict:
    steps = 3  # the first compiles; the peak is the last one's
    none = _compiled_run(ctx, "none", steps)
    _release(ctx.device)
    full = _compiled_run(ctx, "full", steps)
    _release(ctx.device)
    base, got = none.weights, full.weights
    diffs = {n: float((got[n] - w).abs().max()) for n, w in base.items()}
    bitwise = all(torch.equal(got[n], w) for n, w in base.items())
    close = all(torch.allclose(got[n], w, rtol=COMPILED_RTOL, atol=COMPILED_ATOL) for n, w in base.items())
    worst = max(diffs.values())
    backend = ctx.sizes.compile_backend or "inductor"
    compiled = none.graphs > 0 and full.graphs > 0
    if none.peak_bytes is None or full.peak_bytes is None:
        peaks_ok, peak_text = False, "no peak recorded"
    else:
        peaks_ok = full.peak_bytes < none.peak_bytes
        where = "compiled" if ctx.cuda else "eager (CPU ledger)"
        peak_text = (
            f"{where} peak full {format_bytes(full.peak_bytes)} {'<' if peaks_ok else '>='} "
            f"none {format_bytes(none.peak_bytes)}"
        )
    ctx.say(
        f"  {backend}: {none.graphs} + {full.graphs} graphs compiled; {peak_text}; weights after {steps} steps "
        f"max abs diff {worst:.3g}, bitwise {bitwise}"
    )
    return Verdict(
        close and peaks_ok and compiled,
        f"{backend}, {none.graphs}+{full.graphs} graphs: {peak_text}; weights "
        f"{'bitwise equal' if bitwise else f'max abs diff {worst:.3g}'} (tolerance rtol {COMPILED_RTOL:g} "
        f"atol {COMPILED_ATOL:g})",
        {
            "backend": backend,
            "graphs_none": none.graphs,
            "graphs_full": full.graphs,
            "peak_is_compiled": ctx.cuda,
            "peak_none_bytes": none.peak_bytes,
            "peak_full_bytes": full.peak_bytes,
            "weights_bitwise_equal": bitwise,
            "weights_within_tolerance": close,
            "max_abs_diff": worst,
        },
    )


def _in_job_fit(ctx: Context, callbacks: list[L.Callback], steps: int) -> dict[str, torch.Tensor]:
    """The session model trained ``steps`` steps from seed 0 with ``callbacks``; its weights on the host."""
    cfg = ctx.sizes.session_model
    model = _model(cfg)
    trainer = L.Trainer(accelerator=ctx.accelerator, devices=1, max_steps=steps, callbacks=callbacks, **QUIET_TRAINER)
    with _quiet():
        trainer.fit(model, datamodule=_data(cfg, ctx.sizes.session_batch))
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


@contextlib.contextmanager
def _capped(ctx: Context, limit: int) -> Iterator[None]:
    """The device capped at ``limit`` bytes: the CUDA allocator's per-process fraction, or on the CPU the
    plugin's `RECOMPUTE_CPU_MEMORY_LIMIT` (the steps it meters run out of memory as a GPU's would)."""
    from lightning_recompute.meter import CPU_MEMORY_LIMIT

    if ctx.cuda:
        total = torch.cuda.get_device_properties(ctx.device).total_memory
        torch.cuda.set_per_process_memory_fraction(limit / total, ctx.device)
    else:
        os.environ[CPU_MEMORY_LIMIT] = str(limit)
    try:
        yield
    finally:
        if ctx.cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, ctx.device)
        else:
            os.environ.pop(CPU_MEMORY_LIMIT, None)
        _release(ctx.device)


def check_in_job(ctx: Context) -> Verdict:
    """`AutoRecompute` on a device capped between full's and none's peaks, so that none runs out of memory
    for real: racing full and none, none's step must run again under full; with no candidates given, the
    first-batch profile must work from what fits and the planner's choice must train as a plain run."""
    from lightning_recompute.auto import AutoRecompute
    from lightning_recompute.race import RacePlan

    steps = 30
    plan = RacePlan(steps=1, min_rounds=2, max_rounds=4, time_s=1e9, estimate_rounds=2, warmup_steps=1)
    full, none = RecomputePolicy.uniform("full"), RecomputePolicy.uniform("none")
    cfg = ctx.sizes.session_model
    plain = _in_job_fit(ctx, [], steps)
    _release(ctx.device)
    peaks = {}
    with _quiet():
        for label, p in (("full", full), ("none", none)):
            peaks[label] = step_peak(_model(cfg), _data(cfg, ctx.sizes.session_batch), p, accelerator=ctx.accelerator)
            _release(ctx.device)
    capped = (peaks["full"] + peaks["none"]) // 2
    auto = AutoRecompute(10 * peaks["none"], candidates=[full, none], plan=plan)
    planned = AutoRecompute(capped, plan=plan, profile_repeats=1)
    with _capped(ctx, capped):
        tuned = _in_job_fit(ctx, [auto], steps)
    with _capped(ctx, capped):
        tuned_planned = _in_job_fit(ctx, [planned], steps)
    assert auto.decision is not None and auto.race_result is not None and planned.decision is not None
    out_none = auto.race_result.entrants[none.fingerprint()].out
    oom_ok = (out_none or "").startswith("out of memory")
    split_ok = any("does not fit with every layer in none" in n for n in planned.notes)
    chose = auto.decision.short
    chose_ok = auto.decision.policy.fingerprint() == full.fingerprint()
    results = {"given": tuned, "planned": tuned_planned}
    bitwise = {k: all(torch.equal(plain[n], w[n]) for n in plain) for k, w in results.items()}
    close = {k: all(torch.allclose(plain[n], w[n], rtol=1e-4, atol=1e-5) for n in plain) for k, w in results.items()}
    worst = {k: max(float((plain[n] - w[n]).abs().max()) for n in plain) for k, w in results.items()}
    ctx.say(
        f"  peaks full {format_bytes(peaks['full'])}, none {format_bytes(peaks['none'])}; capped at "
        f"{format_bytes(capped)}; none: {out_none or 'raced'}; chose {chose}; the planner's run chose "
        f"{planned.decision.short}; weights vs plain: max abs diff {worst}, bitwise {bitwise}"
    )
    ctx.say(f"  {auto.decision.summary}")
    ctx.say(f"  {planned.decision.summary}; notes: {planned.notes}")
    trains = all(bitwise[k] or (ctx.cuda and close[k]) for k in results)
    return Verdict(
        oom_ok and chose_ok and split_ok and trains,
        f"capped at {format_bytes(capped)}: none ran out of memory and its step ran again under full (chose {chose}); "
        f"without candidates the profile {'split none' if split_ok else 'did NOT split none'} and the planner chose "
        f"{planned.decision.short}; weights after {steps} steps "
        + ("bitwise equal to" if all(bitwise.values()) else f"within max abs diff {max(worst.values()):.3g} of")
        + " a plain run",
        {
            "peak_full_bytes": peaks["full"],
            "peak_none_bytes": peaks["none"],
            "cap_bytes": capped,
            "none_out": out_none,
            "chosen": chose,
            "planned_chosen": planned.decision.short,
            "planned_notes": planned.notes,
            "tuning_steps": auto.tuning_steps,
            "weights_bitwise_equal": bitwise,
            "max_abs_diff": worst,
            "summary": auto.decision.summary,
        },
    )


CHECKS: dict[str, tuple[str, Check]] = {
    "meter": ("CUDA meter vs max_memory_allocated", check_meter),
    "numerics": ("numerics of every mode, SDPA", check_numerics),
    "offload": ("offload: peak drop and throughput", check_offload),
    "session": ("tuning session promotes", check_session),
    "planner": ("planner peak vs measured", check_planner),
    "compile": ("compile: peak and weights", check_compile),
    "in_job": ("tuning inside the job: OOM retry, weights", check_in_job),
}


# ---------------------------------------------------------------------------------------------- running


def environment(device: torch.device) -> dict[str, Any]:
    """Device, driver, torch and CUDA versions (what a reader of a partial run needs first)."""
    import lightning

    env: dict[str, Any] = {
        "device": "cpu",
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            memory=format_bytes(int(props.total_memory)),
            memory_bytes=int(props.total_memory),
            cudnn=torch.backends.cudnn.version(),
            cuda_driver_api=getattr(torch._C, "_cuda_getDriverVersion", lambda: None)(),
            driver=_nvidia_driver(),
        )
    return env


def _nvidia_driver() -> str | None:
    """The NVIDIA kernel module's version, from /proc (no nvidia-smi needed)."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text(encoding="utf-8")
    except OSError:
        return None
    for word in text.split():
        if word[:1].isdigit() and "." in word:
            return word
    return None


def run_checks(
    ctx: Context, names: Sequence[str], after: Callable[[list[CheckResult]], None] = lambda _: None
) -> list[CheckResult]:
    """Run ``names`` in order, each isolated; ``after`` is told the results so far after each one."""
    results: list[CheckResult] = []
    for i, name in enumerate(names, 1):
        title, fn = CHECKS[name]
        ctx.say(f"[{i}/{len(names)}] {name}: {title}")
        started = time.perf_counter()
        try:
            verdict = fn(ctx)
            result = CheckResult(
                name, "pass" if verdict.passed else "fail", 0.0, verdict.summary, _jsonable(verdict.figures)
            )
        except Exception as err:  # noqa: BLE001 - a check's failure is a row of the table, never the end of the run
            oom = is_oom_error(err)
            ctx.say(traceback.format_exc().rstrip())
            result = CheckResult(name, "oom" if oom else "error", 0.0, f"{type(err).__name__}: {_one_line(err)}")
        result.seconds = time.perf_counter() - started
        _release(ctx.device)  # an OOM leaves cached blocks the next check needs
        ctx.say(f"  -> {result.status} in {result.seconds:.1f} s: {result.summary}")
        results.append(result)
        after(results)
    return results


@contextlib.contextmanager
def _lightning_quiet() -> Iterator[None]:
    """Lightning's and the callback's per-fit banners (accelerators, applied policy) would bury the checks'
    lines; the levels are put back after, for a caller that runs `main` in its own process (the tests)."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def table(results: Sequence[CheckResult]) -> str:
    width = max(len(r.name) for r in results)
    lines = [f"{'check':<{width}}  {'status':<7} {'time':>7}  result"]
    for r in results:
        lines.append(f"{r.name:<{width}}  {r.status:<7} {r.seconds:>6.1f}s  {r.summary}")
    return "\n".join(lines)


def _names(value: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECK_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown check {', '.join(map(repr, unknown)) or '(none given)'}; valid: {', '.join(CHECK_NAMES)}"
        )
    return names


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_acceptance.py", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the dry run, tiny sizes")
    parser.add_argument("--only", type=_names, default=None, metavar="A,B", help=f"run only these of {CHECK_NAMES}")
    parser.add_argument("--skip", type=_names, default=[], metavar="A,B", help="run all but these")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checks; 0 when every one that ran passed, 1 otherwise, 2 for bad arguments."""
    try:
        args = parse_args(argv)
    except SystemExit as exit_:  # argparse's usage errors: a status, not an exception, for in-process callers
        return int(exit_.code or 0)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible; use --device cpu for the dry run", file=sys.stderr)
        return 2
    names = [n for n in (args.only or CHECK_NAMES) if n not in args.skip]
    if not names:
        print("--only/--skip: no check left to run", file=sys.stderr)
        return 2
    child_env = dict(os.environ)  # the tuning session's trials run as the product runs them, without the line below
    if args.device == "cuda":
        # The numerics check's deterministic cuBLAS workspace (the gate sets it for its worker); cuBLAS
        # reads it when its handle is created, so before any check touches the device.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")

    def say(line: str) -> None:
        print(line, flush=True)

    started = time.perf_counter()
    env = environment(device)
    say("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))

    def write(results: list[CheckResult]) -> None:
        # After every check, not only at the end: a run cut short (the device's lease ended) keeps its results.
        if args.json is None:
            return
        report = {
            "environment": _jsonable(env),
            "complete": len(results) == len(names),
            "passed": len(results) == len(names) and all(r.status == "pass" for r in results),
            "wall_s": time.perf_counter() - started,
            "checks": [asdict(r) for r in results],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2), encoding="utf-8")

    with tempfile.TemporaryDirectory(prefix="gpu-acceptance-") as scratch:
        ctx = Context(device, CUDA_SIZES if device.type == "cuda" else CPU_SIZES, Path(scratch), say, child_env)
        with _lightning_quiet():
            results = run_checks(ctx, names, after=write)
    wall = time.perf_counter() - started
    passed = all(r.status == "pass" for r in results)
    say("")
    say(table(results))
    verdict = "PASSED" if passed else "FAILED"
    say(f"{verdict}: {sum(r.status == 'pass' for r in results)}/{len(results)} checks in {wall:.0f} s")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
