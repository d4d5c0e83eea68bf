"""Child side of the trial protocol: ``python -m tuner._trials.worker SPEC.json RESULT.json`` writes one JSON
result, atomically, and exits 0 when it has a measurement (out of memory included). On N ranks this process is
rank 0, Lightning starts ranks 1..N-1 by running this same command, and each rank writes its own result.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import faulthandler
import gc
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from lightning_recompute.atomic import atomic_write
from tuner._trials.batches import serve_largest
from tuner._trials.oom import is_oom_error
from tuner._trials.protocol import (
    PARENT_PID_ENV,
    DeviceSpec,
    NumericsResult,
    NumericsSpec,
    ProfileSpec,
    ProtocolError,
    RaceSpec,
    Spec,
    TrialSpec,
    parse_spec,
    rank_result_path,
)

if TYPE_CHECKING:
    from lightning.fabric.connector import _PRECISION_INPUT


def main(argv: Sequence[str] | None = None) -> int:
    """Run the spec in ``argv[0]``, write the result to ``argv[1]``; the process exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m tuner._trials.worker SPEC.json RESULT.json", file=sys.stderr)
        return 2
    die_with_parent(os.environ.get(PARENT_PID_ENV))
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # ranks 1..N-1, started by Lightning from here, follow this one
    try:
        spec = parse_spec(json.loads(Path(args[0]).read_text(encoding="utf-8")))
    except ProtocolError as err:
        # The parent wrote a spec this worker cannot read (another version of the tuner?): nothing runs.
        traceback.print_exc()
        _write(Path(args[1]), {"outcome": "error", "error": _one_line(err), "rank": 0})
        return 1
    rank = int(os.environ.get("LOCAL_RANK", "0")) if spec.ranks > 1 else 0
    result_path = rank_result_path(Path(args[1]), rank) if spec.ranks > 1 else Path(args[1])
    left = None if spec.deadline is None else spec.deadline - time.time() - 1.0
    if left is not None and left > 0:
        # Every thread's stack just before the parent's deadline: the log then says where a hung trial was stuck.
        faulthandler.dump_traceback_later(left, exit=False)
    sys.path.extend(p for p in spec.sys_path if p not in sys.path)
    try:
        payload = _HANDLERS[type(spec)](spec)
    except BaseException as err:  # noqa: BLE001 - everything becomes a result the parent classifies
        traceback.print_exc()
        outcome = "oom" if is_oom_error(err) else "error"
        try:
            device = _device(spec.runs_on)
        except Exception:  # noqa: BLE001 - the device itself may be what failed
            device = {}
        _write(result_path, {"outcome": outcome, "error": _one_line(err), "rank": rank, **device})
        # An OOM is a measurement, not a failure of the worker; except on ranks 1..N-1, where a nonzero
        # status makes Lightning kill every rank at once rather than rank 0 wait in a collective.
        return 0 if outcome == "oom" and rank == 0 else 1
    _write(result_path, {**payload, "rank": rank})
    if rank == 0 and spec.ranks > 1:
        # The tuner kills the whole group once this process exits: wait for the other ranks' results.
        end = spec.deadline or time.time() + 60.0
        paths = [rank_result_path(Path(args[1]), r) for r in range(1, spec.ranks)]
        while time.time() < end and not all(p.exists() for p in paths):
            time.sleep(0.05)
    return 0


def _trial(spec: TrialSpec | Mapping[str, Any]) -> dict[str, Any]:
    import math

    import lightning as L
    import torch

    from lightning_recompute import RecomputeCallback, RecomputePolicy
    from lightning_recompute.race.schedule import machine_state
    from tuner.recipe import build_datamodule, build_model, from_dict

    spec = TrialSpec.of(spec)
    recipe = from_dict(spec.recipe, source=spec.source)
    policy = RecomputePolicy.from_dict(spec.policy, source="trial policy")
    warmup, measure = spec.warmup_steps, spec.measure_steps
    steps, memory_steps = warmup + measure, None
    if recipe.trainer.accelerator == "cpu":
        # The CPU meter costs a Python call per op, more for policies that recompute more: every step up to
        # the measured ones is metered (a leak shows where it peaks), and as many again are timed unmetered.
        memory_steps = range(warmup + measure)
        steps += measure
        if policy.compile:
            # Dynamo runs compiled layers eagerly under the meter: one more unmetered warm-up step compiles
            # them outside the timing.
            steps += 1
    compile_before = _compile_seconds() if policy.compile else None

    L.seed_everything(recipe.search.seed, verbose=False)
    model = build_model(recipe)
    datamodule = build_datamodule(recipe, spec.micro_batch)
    batches = serve_largest(datamodule, recipe.trial.scan_batches)
    callback = RecomputeCallback(policy, layers=recipe.layers, measure_memory=True, memory_steps=memory_steps)
    losses: list[float] = []

    class LossLog(L.Callback):
        # A float: a kept tensor would stay allocated into the next metered step.
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int) -> None:
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            # Manual optimization returning nothing, or a loss that is not a scalar: nothing to check.
            losses.append(float(loss.detach()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else 0.0)

    # max_epochs=-1: a short data module cycles rather than ending the trial early.
    trainer = _trainer(recipe, steps, [callback, LossLog()], max_epochs=-1)
    machine = machine_state(recipe.trainer.accelerator)
    trainer.fit(model, datamodule=datamodule)
    records = list(callback.records)
    if len(records) < steps:
        raise RuntimeError(f"the trainer ran {len(records)} of {steps} steps (warm-up {warmup}, measured {measure})")
    device = _device(recipe.trainer.accelerator)
    bad = next(((i, loss) for i, loss in enumerate(losses, 1) if not math.isfinite(loss)), None)
    if bad is not None:
        why = (
            f"the training loss was {bad[1]} at step {bad[0]} of {steps}; a trial measured on a non-finite loss is "
            "not evidence (does the model train to a finite loss without recompute, on this data and precision?)"
        )
        return {"outcome": "nonfinite", "error": why, **device}
    return {
        "outcome": "ok",
        "warmup_steps": steps - measure if policy.compile else warmup,
        **({} if compile_before is None else {"compile_s": _compile_seconds() - compile_before}),
        "steps": [dataclasses.asdict(r) for r in records],
        "machine": machine,
        **batches(),
        **device,
    }


def _race(spec: RaceSpec | Mapping[str, Any]) -> dict[str, Any]:
    import lightning as L

    from lightning_recompute import RecomputePolicy
    from lightning_recompute.race import RacePlan
    from lightning_recompute.race.schedule import race
    from tuner.recipe import build_datamodule, build_model, from_dict

    spec = RaceSpec.of(spec)
    recipe = from_dict(spec.recipe, source=spec.source)
    L.seed_everything(recipe.search.seed, verbose=False)
    entrants = [
        (e.key, RecomputePolicy.from_dict(e.policy, source=f"race entrant {e.key}"), e.short) for e in spec.entrants
    ]
    datamodule = build_datamodule(recipe, spec.micro_batch)
    batches = serve_largest(datamodule, recipe.trial.scan_batches)
    result = race(
        build_model(recipe),
        datamodule,
        entrants,
        references=spec.references,
        plan=RacePlan.from_dict(spec.plan),
        budget_bytes=spec.budget_bytes,
        layers=recipe.layers,
        trainer_kwargs={"accelerator": recipe.trainer.accelerator, "precision": _precision(recipe.trainer.precision)},
    )
    return {**result, **batches(), **_device(recipe.trainer.accelerator)}


def _trainer(recipe: Any, steps: int, callbacks: list[Any], **kwargs: Any) -> Any:
    """A quiet ``Trainer`` for ``steps`` training steps on the recipe's devices and strategy, no validation."""
    import lightning as L

    from lightning_recompute import QUIET_TRAINER

    strategy = recipe.trainer.strategy
    if strategy == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        # FSDP2 over every rank: Lightning's default makes all ranks one tensor-parallel group, which
        # leaves fully_shard unsharded and feeds every rank the same samples.
        strategy = ModelParallelStrategy(data_parallel_size=recipe.trainer.world_size, tensor_parallel_size=1)
    elif not isinstance(strategy, str):  # a str is one of Lightning's registry names
        strategy = strategy.instantiate()
    return L.Trainer(
        accelerator=recipe.trainer.accelerator,
        devices=recipe.trainer.devices,
        strategy=strategy,
        precision=_precision(recipe.trainer.precision),
        max_steps=steps,
        limit_train_batches=steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **QUIET_TRAINER,
        callbacks=callbacks,
        **kwargs,
    )


def _compile_seconds() -> float:
    """Seconds spent in torch.compile so far (no public counter: what ``TORCH_LOGS`` prints)."""
    from torch._dynamo import utils as dynamo_utils

    spent = dynamo_utils.calculate_time_spent()
    if "total_wall_time" in spent:
        return float(spent["total_wall_time"])
    return float(spent.get("entire_frame_compile", 0.0)) + float(spent.get("entire_backward_compile", 0.0))


# ---------------------------------------------------------------------------------------------- numerics

_Step = tuple[Any, dict[str, Any]]
"""One step's ``(loss, {what: tensor or None})`` on the host: gradients, ``state_dict`` after it, `EVAL_LOSS`."""
EVAL_LOSS = "eval-mode loss"
"""The loss recomputed in eval mode after the step: what BatchNorm's statistics change."""


def _state_after(model: Any, grads: dict[str, Any], local: Callable[[Any], Any]) -> dict[str, Any]:
    out = {f"gradient of {n}": g for n, g in grads.items()}
    out.update({name: local(t) for name, t in model.state_dict().items() if hasattr(t, "detach")})
    return out


def _numerics(spec: NumericsSpec | Mapping[str, Any]) -> dict[str, Any]:
    """No recompute, the policy, no recompute again: same weights, batch and seed, deterministic mode
    (docs/TUNER.md, "What the gate guarantees"); the batch halved where no recompute runs out of memory."""
    import torch

    from lightning_recompute import RecomputePolicy
    from tuner.recipe import from_dict

    spec = NumericsSpec.of(spec)
    recipe = from_dict(spec.recipe, source=spec.source)
    policy = RecomputePolicy.from_dict(spec.policy, source="numerics policy")
    ranked = spec.ranks > 1
    one_step, batch = (_rank_runs if ranked else _one_process_runs)(recipe, policy, spec.micro_batch)
    size = spec.micro_batch if ranked else _batch_size(batch)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    # warn_only: an op without a deterministic kernel still runs; the baseline spread measures it.
    torch.use_deterministic_algorithms(True, warn_only=True)
    skipped: list[int] = []
    try:
        while True:
            part = batch if size is None or not skipped else _first(batch, size)
            try:
                # Baseline first: it keeps every activation, so it is the run that does not fit.
                base, pol, again = one_step(part, False), one_step(part, True), one_step(part, False)
                break
            except BaseException as err:
                if ranked or size is None or size <= 1 or not is_oom_error(err):
                    raise
                skipped.append(size)
                size //= 2
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
    if ranked:
        at = "" if size is None else f" at micro-batch {size}"
        where = f"on rank {os.environ.get('LOCAL_RANK', '0')} ({recipe.trainer.strategy_name}){at}"
    else:
        where = "on the data module's batch" if size is None else f"at micro-batch {size}"
        where += f" (no recompute ran out of memory at {', '.join(map(str, skipped))})" if skipped else ""
    device = _device(recipe.trainer.accelerator)
    on_cpu, gradients = device["device"] == "cpu", "local" if ranked else "parameter"
    verdict = _compare((base, again, pol), compiled=policy.compile, on_cpu=on_cpu, where=where, gradients=gradients)
    return {"outcome": "ok", **dataclasses.asdict(verdict), "micro_batch": size, **device}


def _compare(
    steps: tuple[_Step, _Step, _Step], *, compiled: bool, on_cpu: bool, where: str, gradients: str
) -> NumericsResult:
    """Equal: bitwise; compiled layers within the plugin's tolerance; off CPU within the two baselines' spread."""
    from lightning_recompute.apply import COMPILED_ATOL, COMPILED_RTOL

    base, again, pol = steps
    spread, _ = _max_diff(base, again)
    diff, differing = _max_diff(base, pol)
    # The tensors in words: "loss, 12 parameter gradients, 12 parameters, 6 buffers and the eval-mode loss".
    grads = sum(k.startswith("gradient of ") for k in base[1])
    params = sum(not k.startswith("gradient of ") and f"gradient of {k}" in base[1] for k in base[1])
    parts = [f"loss, {grads} {gradients} gradients", f"{params} parameters"]
    parts.append(f"{len(base[1]) - grads - params - (EVAL_LOSS in base[1])} buffers")
    parts += ["the eval-mode loss"] if EVAL_LOSS in base[1] else []
    what = ", ".join(parts[:-1]) + " and " + parts[-1]
    base_bad = _nonfinite(base)
    equal = True
    if base_bad:
        # nan != nan: every value would "differ" and the policy would be blamed for the model's own state.
        equal = False
        detail = (
            f"the run without recompute is itself non-finite {where} ({base_bad}): the model or its data "
            f"produces nan/inf, whatever the policy, so numerics cannot be compared; fix training first"
        )
    elif not differing:
        detail = f"{what} bitwise equal {where}"
    elif compiled and _max_diff(base, pol, close=True)[1] == []:
        # Compiled layers reorder float operations: held to the plugin's stated tolerance, not bitwise.
        detail = (
            f"max abs diff {diff:.3g} {where}, within the compiled-layer tolerance "
            f"(rtol {COMPILED_RTOL:g}, atol {COMPILED_ATOL:g})"
        )
    elif spread > 0 and not on_cpu and diff <= spread:
        detail = (
            f"max abs diff {diff:.3g} {where}, within the spread {spread:.3g} of two runs without recompute "
            f"(nondeterministic kernels)"
        )
    else:
        equal = False
        worst = max(differing)
        rule = (
            "bitwise equality is the rule on CPU"
            if on_cpu
            else f"two runs without recompute differ by {spread:.3g}"
            if spread > 0
            else "two runs without recompute are bitwise equal"
        )
        detail = (
            f"{len(differing)} of {len(base[1]) + 1} tensors ({what}) differ {where}, first {differing[0][1]}, "
            f"most at {worst[1]} ({worst[0]:.3g}); {rule}"
        )
    return NumericsResult(equal=equal, max_abs_diff=diff, baseline_spread=spread, detail=detail)


def _one_process_runs(recipe: Any, policy: Any, micro_batch: int | None) -> tuple[Callable[..., _Step], Any]:
    """Runs with Fabric on one device, on the data module's first batch."""
    import torch
    from lightning.fabric import Fabric

    from lightning_recompute import apply_policy
    from tuner.recipe import build_datamodule, build_model

    seed = recipe.search.seed
    fabric = Fabric(accelerator=recipe.trainer.accelerator, devices=1, precision=_precision(recipe.trainer.precision))
    datamodule = build_datamodule(recipe, micro_batch)
    datamodule.prepare_data()
    datamodule.setup("fit")

    def one_step(batch: Any, with_policy: bool) -> _Step:
        fabric.seed_everything(seed, verbose=False)  # every run starts from the same weights
        model = build_model(recipe)
        if with_policy:
            apply_policy(model, policy, recipe.layers)
        try:
            wrapped = fabric.setup_module(model)
            wrapped.train()  # dropout active: recomputation must replay the same masks
            fabric.seed_everything(seed + 1, verbose=False)
            on_device = fabric.to_device(batch)
            with _capped(fabric.device, model, on_device):
                out = wrapped.training_step(on_device, 0)
                loss = out["loss"] if isinstance(out, Mapping) else out
                fabric.backward(loss)
            # Gradients move to host memory so only one model occupies the device at a time.
            grads = {n: (None if p.grad is None else p.grad.detach().cpu()) for n, p in model.named_parameters()}
            compared = _state_after(model, grads, lambda t: t.detach().cpu().clone())
            # The model as it evaluates now: a policy that changed a buffer (BatchNorm's statistics) shows here.
            wrapped.eval()
            with torch.no_grad():
                fabric.seed_everything(seed + 1, verbose=False)
                out = wrapped.training_step(fabric.to_device(batch), 0)
            compared[EVAL_LOSS] = (out["loss"] if isinstance(out, Mapping) else out).detach().float().cpu()
            return loss.detach().float().cpu(), compared
        finally:
            del model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    return one_step, next(iter(datamodule.train_dataloader()))


def _capped(device: Any, *tracked: Any) -> Any:
    """The step under the capped CPU's ledger, so that no recompute runs out of memory there as on a GPU."""
    from lightning_recompute.meter import StorageMeter, cpu_memory_limit

    if device.type != "cpu" or cpu_memory_limit() is None:
        return contextlib.nullcontext()
    meter = StorageMeter(device)
    meter.track(*tracked)
    return meter


def _rank_runs(recipe: Any, policy: Any, micro_batch: int | None) -> tuple[Callable[..., _Step], Any]:
    """Runs of one `Trainer` step as this rank of N, comparing what it holds (DDP's all-reduced gradients, FSDP's
    shards); the parent merges the ranks."""
    import lightning as L
    import torch

    from lightning_recompute import RecomputeCallback
    from tuner.recipe import build_datamodule, build_model

    seed = recipe.search.seed

    class CaptureStep(L.Callback):
        loss: Any = None
        step: _Step | None = None

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
            torch.manual_seed(seed + 1)  # the dropout masks
            if torch.cuda.is_available():
                torch.cuda.manual_seed_all(seed + 1)

        def on_before_backward(self, trainer: Any, module: Any, loss: Any) -> None:
            self.loss = loss.detach().float().cpu()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int) -> None:
            # After `RecomputeCallback` stopped metering the step: on a capped CPU the host copies would
            # run it out of memory.
            grads = {n: (None if p.grad is None else _local(p.grad)) for n, p in module.named_parameters()}
            self.step = (self.loss, _state_after(module, grads, _local))

    def one_step(_: Any, with_policy: bool) -> _Step:
        L.seed_everything(seed, verbose=False)  # every run starts from the same weights
        model, capture = build_model(recipe), CaptureStep()
        callbacks: list[L.Callback] = [RecomputeCallback(policy, layers=recipe.layers)] if with_policy else []
        trainer = _trainer(recipe, 1, [*callbacks, capture])
        trainer.fit(model, datamodule=build_datamodule(recipe, micro_batch))
        if capture.step is None:
            raise RuntimeError("the numerics run ended before its first backward")
        return capture.step

    return one_step, None


def _local(grad: Any) -> Any:
    """On the host: a DTensor's local shard, else the tensor."""
    to_local = getattr(grad, "to_local", None)
    return (to_local() if callable(to_local) else grad).detach().cpu().clone()


def _batch_size(batch: Any) -> int | None:
    import torch
    from lightning_utilities.core.apply_func import apply_to_collection

    sizes: list[int] = []
    apply_to_collection(batch, torch.Tensor, lambda t: sizes.append(int(t.shape[0])) if t.dim() else None)
    return sizes[0] if sizes else None


def _first(batch: Any, k: int) -> Any:
    import torch
    from lightning_utilities.core.apply_func import apply_to_collection

    return apply_to_collection(batch, torch.Tensor, lambda t: t[:k] if t.dim() else t)


def _nonfinite(step: _Step) -> str | None:
    """What in one step's loss and gradients is nan or inf, in words."""
    import torch

    loss, grads = step
    # The loss, the gradients and the eval-mode loss: a buffer may hold inf by design (an additive causal mask).
    checked = {k: v for k, v in grads.items() if k.startswith("gradient of ") or k == EVAL_LOSS}
    bad = [name for name, g in checked.items() if g is not None and not bool(torch.isfinite(g.float()).all())]
    parts = [] if bool(torch.isfinite(loss).all()) else [f"loss {loss.flatten()[0].item()}"]
    if bad:
        parts.append(f"{len(bad)} of {len(checked)} gradients and losses, first {bad[0]}")
    return "; ".join(parts) or None


def _max_diff(a: _Step, b: _Step, *, close: bool = False) -> tuple[float, list[tuple[float, str]]]:
    """The largest absolute difference and every differing ``(diff, name)``; ``close``: beyond compiled tolerance."""
    import torch

    from lightning_recompute.apply import COMPILED_ATOL, COMPILED_RTOL

    differing: list[tuple[float, str]] = []
    for name, x, y in [("loss", a[0], b[0]), *((name, ga, b[1].get(name)) for name, ga in a[1].items())]:
        if x is None or y is None:
            if (x is None) != (y is None):
                differing.append((float("inf"), name))
        elif x.shape != y.shape:
            differing.append((float("inf"), name))
        elif not (
            torch.allclose(y.float(), x.float(), rtol=COMPILED_RTOL, atol=COMPILED_ATOL) if close else torch.equal(x, y)
        ):
            differing.append((float((x.float() - y.float()).abs().max()), name))
    return max((d for d, _ in differing), default=0.0), differing


def _precision(value: str) -> _PRECISION_INPUT:
    # The recipe checked ``value`` against Lightning's list; its schema keeps a str so that loading needs no Lightning.
    return cast("_PRECISION_INPUT", value)


def _device(accelerator: str) -> dict[str, Any]:
    import torch

    if accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available()):
        return {"device": "cpu", "device_total_bytes": None}
    if not torch.cuda.is_available():
        raise RuntimeError(f"trainer.accelerator is {accelerator!r} but no CUDA device is visible to this process")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"device": props.name, "device_total_bytes": int(props.total_memory)}


def _profile(spec: ProfileSpec) -> dict[str, Any]:
    from tuner.recipe import from_dict
    from tuner.recipe._profile import profile_recipe_here

    recipe = from_dict(spec.recipe, source=spec.source)
    return {"outcome": "ok", "profile": profile_recipe_here(recipe, spec.micro_batch, spec.repeats).to_dict()}


def die_with_parent(parent: str | None) -> None:
    """End this process when ``parent`` dies: by the kernel (``PR_SET_PDEATHSIG``), else by a watchdog thread."""
    if not parent or not parent.isdigit() or int(parent) == os.getpid():
        return  # started by hand, or `main` called again in the process that set the variable: nobody to follow
    expected, armed = int(parent), False
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            armed = ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG
    if os.getppid() != expected:
        os._exit(1)  # the parent died before the kernel was told to follow it; nothing started yet
    if armed:
        return

    def watch() -> None:
        while os.getppid() == expected:
            time.sleep(1.0)
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)  # the whole group: what the worker started too
        os._exit(1)

    threading.Thread(target=watch, name="recompute-parent-watchdog", daemon=True).start()


def _write(path: Path, payload: Mapping[str, Any]) -> None:
    # The parent may find this process killed at any instant; it must see a whole result or none.
    atomic_write(path, json.dumps(payload))


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    text = text[:497] + "..." if len(text) > 500 else text
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


_HANDLERS: dict[type[Spec], Callable[[Any], dict[str, Any]]] = {
    TrialSpec: _trial,
    NumericsSpec: _numerics,
    DeviceSpec: lambda spec: {"outcome": "ok", **_device(spec.accelerator)},
    ProfileSpec: _profile,
    RaceSpec: _race,
}


if __name__ == "__main__":
    status = main()
    # The result is written; frozen, the objects torch and Lightning made are left to the process's exit
    # rather than walked by interpreter shutdown, a cost every worker would pay.
    gc.freeze()
    sys.exit(status)
