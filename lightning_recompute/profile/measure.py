"""Measuring a profile (`profile_model`). The planner relies on its conventions: the second step is profiled (optimizer
state in the base), ``zero_grad`` is a segment of its own after the loss, every layer runs once per step in order,
and a layer's ``net`` is the same in every mode."""

from __future__ import annotations

import gc
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.weak import WeakIdKeyDictionary

from lightning_recompute import RecomputePolicy, applied_policy, apply_policy, find_layers, remove_policy
from lightning_recompute.grads import module_blockers
from lightning_recompute.layers import LayerSpec
from lightning_recompute.meter import MemoryMeter, StorageMeter, memory_meter, synchronize
from lightning_recompute.policy import Mode
from lightning_recompute.profile.model import ALL_MODES, BASE_MODES, LayerProfile, Profile, ProfileError, SegmentCost

LossFn = Callable[[nn.Module, Any], torch.Tensor]
NONE, OFFLOAD = Mode.NONE.value, Mode.OFFLOAD.value


@dataclass
class Event:
    """One marked boundary of a profiled step: the memory level and counters at that point."""

    label: str
    level: int
    peak: int  # highest level since the previous event
    grad: int  # bytes of parameter gradients alive
    seconds: float
    flops: int
    traffic: int
    offload: int


class TrafficMode(TorchDispatchMode):
    """Bytes read and written by ops `FlopCounterMode` has no formula for: the memory-bound ones."""

    def __init__(self) -> None:
        super().__init__()
        self.registry = FlopCounterMode(display=False).flop_registry
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in self.registry or any(r.alias_info is not None for r in func._schema.returns):
            return out  # compute-bound (counted as FLOPs), or a view: no traffic of its own
        self.total += sum(
            t.numel() * t.element_size() for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)
        )
        return out


@dataclass(eq=False)
class Recorder:
    """Marks segment boundaries: layer hooks in forward, tensor hooks in backward."""

    run: ProfilingRun
    meter: MemoryMeter | None = None
    flops: FlopCounterMode | None = None
    traffic: TrafficMode | None = None
    emulate_offload: bool = False
    clock: Callable[[], float] = time.perf_counter
    events: list[Event] = field(default_factory=list)
    input_shapes: dict[int, str] = field(default_factory=dict)
    offloaded: int = 0
    _hooked: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # tensor -> its hook's labels
    _handles: list[Any] = field(default_factory=list)
    _offloading: Any = None  # the emulated offload's saved-tensor hooks, entered in a layer's forward

    def __enter__(self) -> Recorder:
        for i, (_, module) in enumerate(self.run.layers):
            self._handles.append(module.register_forward_pre_hook(partial(self._pre_hook, i), with_kwargs=True))
            self._handles.append(module.register_forward_hook(partial(self._post_hook, i), with_kwargs=True))
        # The end of the model's forward: where FSDP2's root frees the last layer's all-gather buffer.
        self._handles.append(self.run.model.register_forward_hook(self._output_hook))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._end_offload()

    def _end_offload(self) -> None:
        if self._offloading is not None:
            self._offloading.__exit__(None, None, None)
            self._offloading = None

    def mark(self, label: str) -> None:
        level = peak = 0
        if self.meter is not None:
            level, peak = self.meter.current_bytes, self.meter.peak_bytes
            self.meter.reset_peak()
        else:
            synchronize(self.run.device)  # timing run: the clock must see queued device work
        grad = _storage_bytes((p.grad for p in self.run.model.parameters()), self.run.device.type)
        flops = self.flops.get_total_flops() if self.flops is not None else 0
        traffic = self.traffic.total if self.traffic is not None else 0
        self.events.append(Event(label, level, peak, grad, self.clock(), flops, traffic, self.offloaded))

    def _hook_tensor(self, obj: Any, label: str, first: bool) -> torch.Tensor | None:
        """Marks ``label`` when the gradient of the first tensor in ``obj`` that needs one arrives."""
        t = next((v for v in tree_flatten(obj)[0] if isinstance(v, torch.Tensor) and v.requires_grad), None)
        if t is None:
            return None
        labels = self._hooked.get(t)
        if labels is not None:  # one layer's output is the next one's input: one hook, labels in backward order
            labels.insert(0 if first else len(labels), label)
            return t
        labels = self._hooked[t] = [label]

        def hook(_grad: torch.Tensor) -> None:
            for lab in labels:
                self.mark(lab)

        t.register_hook(hook)
        return t

    def _output_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and not any(e.label == "output" for e in self.events):
            self.mark("output")

    def _pre_hook(self, i: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():
            return
        self.mark(f"fwd_start:{i}")
        t = self._hook_tensor((args, kwargs), f"bwd_end:{i}", first=True)
        if t is not None:
            self.input_shapes[i] = f"{tuple(t.shape)}:{t.dtype}"
        if self.emulate_offload:
            self._offloading = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._offloading.__enter__()

    def _post_hook(self, i: int, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        self._end_offload()
        self.mark(f"fwd_end:{i}")
        self._hook_tensor(output, f"bwd_start:{i}", first=False)

    # save_on_cpu minus the host copy: forgotten in forward (only its shape kept), allocated anew in backward.
    def _pack(self, t: torch.Tensor) -> Any:
        if t.device.type != self.run.device.type:
            return t
        self.offloaded += t.numel() * t.element_size()
        return t.size(), t.dtype, t.device

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        size, dtype, device = packed
        self.offloaded += math.prod(size) * dtype.itemsize
        return torch.empty(size, dtype=dtype, device=device)


def _storage_bytes(tensors: Iterable[Any], device_type: str) -> int:
    """Bytes of the distinct storages of the tensors on ``device_type`` (anything else is skipped)."""
    seen = {
        t.untyped_storage()._cdata: t.untyped_storage().nbytes()
        for t in tensors
        if isinstance(t, torch.Tensor) and t.device.type == device_type
    }
    return sum(seen.values())


def _batch_size(batch: Any) -> int:
    for v in tree_flatten(batch)[0]:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
    raise ProfileError("batch: found no tensor with a batch dimension in the batch")


def _default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """``training_step`` for a LightningModule; ``model.loss(batch)`` if it has one; else ``model(batch)``."""
    if isinstance(model, L.LightningModule):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*self.log.*")
            out: Any = model.training_step(batch, 0)
        return out["loss"] if isinstance(out, dict) else out
    loss = getattr(model, "loss", None)
    return loss(batch) if callable(loss) else model(batch)


def _make_optimizer(model: nn.Module, optimizer: Any, notes: list[str]) -> torch.optim.Optimizer:
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        return optimizer(model.parameters())
    if optimizer is not None:
        raise ProfileError(
            f"optimizer: expected an Optimizer, a callable params -> Optimizer, or None; got {type(optimizer).__name__}"
        )
    configure = getattr(model, "configure_optimizers", None)
    if not callable(configure):
        notes.append("optimizer: none given and the model has no configure_optimizers; profiled with AdamW")
        return torch.optim.AdamW(model.parameters())
    out = configure()
    found = next((o for o in tree_flatten(out)[0] if isinstance(o, torch.optim.Optimizer)), None)
    if found is None:
        raise ProfileError(
            f"optimizer: {type(model).__name__}.configure_optimizers() returned {type(out).__name__}, "
            f"in which no torch.optim.Optimizer was found; pass optimizer= explicitly"
        )
    return found


def _costs(events: list[Event], n_layers: int) -> list[tuple[str, SegmentCost]]:
    """The events cut into keyed segments (`Profile.timeline`) and what each cost."""
    out: list[tuple[str, SegmentCost]] = []
    k = 0
    while k < len(events) - 1:
        kind, _, idx = events[k].label.partition(":")
        end = k + 1
        if kind == "fwd_start":
            # The gap after a layer's forward belongs to it (an offloaded layer's input is freed there).
            after = events[end + 1].label if end + 1 < len(events) else ""
            if events[end].label == f"fwd_end:{idx}" and after.startswith("fwd_start:"):
                end += 1
            key = f"fwd:{idx}"
        elif kind == "bwd_start":
            key = f"bwd:{idx}"
        else:
            key = f"fixed:{events[k].label}->{events[end].label}"
        a, b = events[k], events[end]
        growth = {f: getattr(b, f) - getattr(a, f) for f in ("grad", "seconds", "flops", "traffic", "offload")}
        peak = max(0, max(e.peak for e in events[k + 1 : end + 1]) - a.level)
        out.append((key, SegmentCost(b.level - a.level, peak, **growth, scales=key != "fixed:backward->optimizer")))
        k = end
    seen = [key for key, _ in out if not key.startswith("fixed:")]
    if seen != [f"fwd:{i}" for i in range(n_layers)] + [f"bwd:{i}" for i in reversed(range(n_layers))]:
        raise ProfileError(
            "the step did not run each layer once in order with backward in reverse order "
            f"(segments seen: {seen[:8]}{' ...' if len(seen) > 8 else ''}); the planner models a stack of layers "
            "each called once per step. Choose layers= that the model calls exactly once each"
        )
    return out


def check_modes(modes: Sequence[str] | None) -> list[str]:
    """``modes`` checked and normalised (``none`` first); the base modes for ``None``."""
    if modes is None:
        return list(BASE_MODES)
    out = [m.value if isinstance(m, Mode) else str(m).strip().lower() for m in modes]
    for m, name in zip(modes, out, strict=True):
        if name not in ALL_MODES:
            raise ProfileError(f"modes: unknown mode {m!r}; valid modes are: {', '.join(ALL_MODES)}")
    if not out:
        raise ProfileError(f"modes: empty; valid modes are: {', '.join(ALL_MODES)}")
    if NONE not in out:
        out.insert(0, NONE)  # the reference every recomputation is measured against
    return list(dict.fromkeys(out))


@dataclass
class Metered:
    """One mode's metered steps: a group of layers in the mode per step, the rest in a mode that keeps less
    (one group of every layer where that fits; each layer is measured in its own place)."""

    groups: list[list[int]]
    policies: list[str | RecomputePolicy]
    runs: list[Recorder]

    def pick(self, per_run: list[dict[str, Any]]) -> dict[str, Any]:
        """Each layer's entries from the run where it was in the mode, the rest from the first run."""
        owner = {i: g for g, members in enumerate(self.groups) for i in members}

        def source(key: str) -> int:
            kind, _, idx = key.partition(":")
            return owner[int(idx)] if kind in ("fwd", "bwd") else 0

        return {key: per_run[source(key)][key] for key in per_run[0]}

    def costs(self, n_layers: int) -> tuple[list[str], dict[str, SegmentCost]]:
        """The step's segment keys in order, and each one's cost."""
        per_run = [_costs(rec.events, n_layers) for rec in self.runs]
        return [key for key, _ in per_run[0]], self.pick([dict(costs) for costs in per_run])


class ProfilingRun:
    """Shared machinery of `profile_model` and `profile_meta`: one model, one batch, uniform-mode runs."""

    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        layers: LayerSpec,
        modes: list[str],
        optimizer: Any,
        loss_fn: LossFn | None,
        device: torch.device,
        free_grads_at_batch_start: bool | None = None,
    ) -> None:
        self.model, self.batch, self.layer_spec, self.modes, self.device = model, batch, layers, modes, device
        self.rest = Mode.FULL.value if Mode.FULL.value in modes else NONE  # the mode that keeps least
        self.free_grads = bool(free_grads_at_batch_start)
        if free_grads_at_batch_start is None:  # `RecomputeCallback`'s default; without Lightning, the profile's order
            self.free_grads = isinstance(model, L.LightningModule) and not any(module_blockers(model))
        self.notes: list[str] = []
        self.layers = find_layers(model, layers)
        if loss_fn is None and isinstance(model, L.LightningModule) and not model.automatic_optimization:
            raise ProfileError(
                f"model: {type(model).__name__} uses manual optimization;"
                f" pass loss_fn=(model, batch) -> loss to profile it"
            )
        self.loss_fn = loss_fn or _default_loss
        self.optimizer = _make_optimizer(model, optimizer, self.notes)

    def apply(self, mode: str | RecomputePolicy) -> None:
        policy = mode if isinstance(mode, RecomputePolicy) else RecomputePolicy.uniform(mode)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*offload.*")
            apply_policy(self.model, policy, self.layer_spec)

    def step(self, rec: Recorder | None) -> None:
        mark = rec.mark if rec is not None else (lambda label: None)
        mark("step")
        loss = self.loss_fn(self.model, self.batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ProfileError(
                f"loss_fn: must return a scalar loss tensor, got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            )
        mark("loss")
        # Where Lightning's automatic optimisation zeroes gradients; its own segment, so the planner can move it.
        self.optimizer.zero_grad(set_to_none=True)
        mark("zero_grad")
        loss.backward()
        del loss
        mark("backward")
        self.optimizer.step()
        mark("optimizer")

    def meter(self, modes: list[str]) -> dict[str, Metered]:
        """After a warm-up step, each mode's memory runs, the mode that keeps least first (the others' fallback)."""
        self.warm_up()
        return {m: self.metered(m) for m in sorted(modes, key=lambda m: m != self.rest)}

    def warm_up(self) -> None:
        """A step in the mode that keeps least: the optimizer state in the base, and after an out-of-memory step
        (called outside its ``except``, whose traceback holds its activations) every gradient again."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.apply(self.rest)
        self.step(None)

    def memory_run(self, mode: str | RecomputePolicy) -> Recorder:
        """Two untimed steps in ``mode``: memory and traffic from the first, FLOPs from the second (FlopCounterMode's
        module tracker keeps recomputed tensors alive, which the meter would see)."""
        emulate = mode == OFFLOAD and self.device.type == "meta"
        self.apply(NONE if emulate else mode)
        meter = memory_meter(self.device)
        meter.track(self.model, self.optimizer, self.batch)
        traffic = TrafficMode()
        try:
            with Recorder(self, meter, None, traffic, emulate, clock=float) as rec, meter, traffic:
                self.step(rec)
        finally:
            if isinstance(meter, StorageMeter):
                meter.close()
        counter = FlopCounterMode(display=False)
        with Recorder(self, None, counter, None, emulate, clock=float) as frec, counter:
            self.step(frec)
        if [e.label for e in frec.events] != [e.label for e in rec.events]:
            raise ProfileError(
                f"mode {mode}: two identical steps ran different layer sequences; the model's control flow varies"
            )
        for e, f in zip(rec.events, frec.events, strict=False):
            e.flops = f.flops
        return rec

    def metered(self, mode: str) -> Metered:
        """``mode``'s memory runs: every layer in it, else 2, 4, ... groups (the others in ``rest``) until each fits."""
        n, k, rest = len(self.layers), 1, self.rest
        while True:
            size = -(-n // min(k, n))  # contiguous groups, as even as can be
            groups = [list(range(i, min(n, i + size))) for i in range(0, n, size)]
            in_groups = [{name: mode if i in g else rest for i, (name, _) in enumerate(self.layers)} for g in groups]
            policies: list[str | RecomputePolicy] = (
                [mode] if k == 1 else list(map(RecomputePolicy.from_modes, in_groups))
            )
            try:
                runs = [self.memory_run(p) for p in policies]
            except torch.OutOfMemoryError:
                runs = []
            if runs:
                break
            self.warm_up()
            if mode == rest:
                raise torch.OutOfMemoryError(
                    f"the model does not fit on {self.device} even with every layer in {rest} (out of memory at "
                    f"micro-batch {_batch_size(self.batch)}); a smaller micro-batch, or more devices, is needed"
                )
            if k >= n:
                raise torch.OutOfMemoryError(
                    f"mode {mode}: one layer in it, the others in {rest}, does not fit on {self.device}"
                )
            k *= 2
        if k > 1:
            self.notes.append(
                f"{mode}: does not fit with every layer in it (out of memory); profiled in {len(groups)} steps, "
                f"each with {len(groups[0])} layer(s) in {mode} and the rest {rest}"
            )
        return Metered(groups, policies, runs)

    def build(
        self,
        mem: dict[str, Metered],
        times: dict[str, list[dict[str, float]]] | None,
        time_source: str,
        hardware: str | None = None,
    ) -> Profile:
        n = len(self.layers)
        keys = mem[NONE].costs(n)[0]
        by_mode: dict[str, dict[str, SegmentCost]] = {}
        for m, rec in mem.items():
            mode_keys, by_mode[m] = rec.costs(n)
            if mode_keys != keys:
                raise ProfileError(
                    f"the step's structure differs between mode none and mode {m} "
                    f"({len(keys)} vs {len(mode_keys)} segments); the model must call the same layers in the same order"
                )
        rec0 = mem[NONE].runs[0]
        # Layers alike enough (class, parameter shapes, input shape) share time samples.
        groups: dict[str, list[int]] = {}
        layers: list[LayerProfile] = []
        for i, (name, module) in enumerate(self.layers):
            params = ",".join(f"{p_name}{tuple(p.shape)}:{str(p.dtype)[6:]}" for p_name, p in module.named_parameters())
            group = f"{type(module).__qualname__}[{params}]<-{rec0.input_shapes.get(i, '?')}"
            groups.setdefault(group, []).append(i)
            fwd = {m: by_mode[m][f"fwd:{i}"] for m in self.modes}
            bwd = {m: by_mode[m][f"bwd:{i}"] for m in self.modes}
            nets = {m: fwd[m].delta + bwd[m].delta for m in self.modes}
            if max(nets.values()) - min(nets.values()) > max(1024, 0.01 * abs(fwd[NONE].delta)):
                self.notes.append(
                    f"{name}: forward+backward leaves {max(nets.values()) - min(nets.values())} bytes more in some "
                    f"mode than in another ({nets}); the planner uses mode none's {nets[NONE]}"
                )
            param_bytes = _storage_bytes(module.parameters(), self.device.type)
            layers.append(LayerProfile(name, group, param_bytes, fwd, bwd, nets[NONE]))
        fixed = {k[len("fixed:") :]: c for k, c in by_mode[NONE].items() if k.startswith("fixed:")}
        names = {group: [layers[i].name for i in members] for group, members in groups.items()}
        if times is not None:
            for mode in self.modes:
                runs = times.get(mode, times[NONE])  # offload on CPU is none: none's samples, not noisier ones
                for members in groups.values():
                    for phase in ("fwd", "bwd"):
                        med = statistics.median(run[f"{phase}:{i}"] for run in runs for i in members)
                        for i in members:
                            getattr(layers[i], phase)[mode].seconds = med
            for key, cost in fixed.items():
                cost.seconds = statistics.median(run[f"fixed:{key}"] for run in times[NONE])
            shared = [g for g in names.values() if len(g) > 1]
            if shared:
                spans = "; ".join(f"{g[0]} .. {g[-1]} ({len(g)})" for g in shared)
                self.notes.append(
                    "time: layers of identical class, parameter shapes and input shape share their time samples "
                    f"(median of the pooled samples): {spans}; memory is per layer"
                )
        dev = self.device.type
        return Profile(
            layers=layers,
            timeline=keys,
            fixed=fixed,
            modes=list(self.modes),
            base_bytes=rec0.events[0].level,
            param_bytes=_storage_bytes(self.model.parameters(), dev),
            # A gradient is the size of its parameter (per-segment growth would miss the head's).
            grad_bytes=_storage_bytes((p for p in self.model.parameters() if p.requires_grad), dev),
            optimizer_bytes=_storage_bytes((v for s in self.optimizer.state.values() for v in s.values()), dev),
            batch_bytes=_storage_bytes(tree_flatten(self.batch)[0], dev),
            micro_batch=_batch_size(self.batch),
            device=str(self.device),
            time_source=time_source,
            hardware=hardware,
            groups=names,
            notes=self.notes,
            free_grads_at_batch_start=self.free_grads,
            split={m: len(rec.groups) for m, rec in mem.items() if len(rec.groups) > 1 and m in self.modes},
        )


def profile_model(
    model: nn.Module,
    batch: Any,
    layers: LayerSpec = "auto",
    *,
    modes: Sequence[str] | None = None,
    optimizer: torch.optim.Optimizer | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    loss_fn: LossFn | None = None,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    free_grads_at_batch_start: bool | None = None,
) -> Profile:
    """Measure each layer's memory and time per mode in a training step of ``model`` on ``batch``: one metered step
    per mode, then ``repeats`` timed rounds (docs/AUTO.md); ``loss_fn``/``optimizer`` replace a LightningModule's
    own, ``clock=time.thread_time`` times only this thread on a shared CPU; parameters are put back after."""
    if not isinstance(model, nn.Module):
        raise ProfileError(f"model: expected an nn.Module, got {type(model).__name__}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ProfileError(f"repeats: must be a positive integer, got {repeats!r}")
    param = next(model.parameters(), None)
    if param is None:
        raise ProfileError(f"model: {type(model).__name__} has no parameters; nothing to train, nothing to profile")
    device = param.device
    if device.type == "meta":
        raise ProfileError(
            "model: its parameters are on the meta device; use profile_meta(model_factory, batch)"
            " to plan without memory"
        )
    mode_list = check_modes(modes)
    batch = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)
    previous = applied_policy(model)
    snapshot = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    was_training = model.training
    model.train()
    try:
        run = ProfilingRun(model, batch, layers, mode_list, optimizer, loss_fn, device, free_grads_at_batch_start)
        # On CPU offload is none: measured once, as none.
        measured = [m for m in mode_list if not (m == OFFLOAD and device.type != "cuda")]
        if len(measured) < len(mode_list):
            run.notes.append("offload: the plugin runs it as none on this device; its costs are none's")
        mem = run.meter(measured)
        for m in mode_list:
            mem.setdefault(m, mem[NONE])
        times: dict[str, list[dict[str, float]]] = {m: [] for m in measured}
        for r in range(repeats + 1):  # round 0 warms each mode's code paths up; it is not kept
            for m in measured[r % len(measured) :] + measured[: r % len(measured)]:
                timed = []
                for policy in mem[m].policies:
                    run.apply(policy)
                    with Recorder(run, clock=clock) as rec:
                        run.step(rec)
                    timed.append({k: c.seconds for k, c in _costs(rec.events, len(run.layers))})
                if r > 0:
                    times[m].append(mem[m].pick(timed))
        return run.build(mem, times, "measured")
    finally:
        remove_policy(model)
        if previous is not None:
            apply_policy(model, previous.policy, layers)
        model.load_state_dict(snapshot)
        model.train(was_training)
