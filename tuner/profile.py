"""Per-layer cost profile of one training step: memory, time and FLOPs per recompute mode.

A training step is cut into *segments* at the boundaries of the layers found by
`lightning_recompute.find_layers`::

    fixed (embeddings ...) | fwd:0 | fwd:1 | ... | fixed (head, loss) | fixed (head backward) |
    bwd:L-1 | ... | bwd:0 | fixed (embedding backward) | fixed (optimizer step)

Forward boundaries come from module hooks on each layer; backward boundaries from tensor hooks on
each layer's output (its backward starts when the gradient of its output is complete) and input
(its backward ends when the gradient of its input is). For every segment the profile records the
change of live tensor memory across it (``delta``), the highest point above its starting level
(``peak``, the transient), the bytes of parameter gradients it allocated (``grad``), its FLOPs
(`torch.utils.flop_counter.FlopCounterMode`), and its time. A layer's segments are measured once
per mode (one step with every layer in that mode), the rest once (they do not depend on the
policy). `tuner.planner.Planner` composes them into the peak and step time of any mixed policy.

Memory comes from the plugin's meters (`lightning_recompute.meter.memory_meter`): the CUDA
allocator's statistics on CUDA, and on CPU and meta the exact storage ledger of `StorageMeter`,
which is also what makes `profile_meta` possible: the same step on the meta device allocates
nothing, yet the ledger counts every byte a GPU would hold.

Entry points::

    profile_model(model, batch, layers="auto", *, modes=None, optimizer=None, loss_fn=None,
                  repeats=5, restore=True, clock=time.perf_counter) -> Profile
    profile_meta(model_factory, batch, layers="auto", *, modes=None, optimizer=None, loss_fn=None,
                 hardware="H100", mfu=0.5) -> Profile
    Profile.to_dict() / Profile.from_dict(d) / to_json() / from_json(s)

Conventions and assumptions (the planner relies on them):

- The step is ``loss = loss_fn(model, batch); optimizer.zero_grad(set_to_none=True);
  loss.backward(); optimizer.step()``, in the order Lightning's automatic optimisation runs it:
  the previous step's gradients are alive through the forward and freed just before backward.
  The profiled step is the second one, so optimizer state and gradients exist (part of the base
  level, not of the step).
- Every layer runs once per step, in order, and its backward runs after every later layer's.
- A layer's ``fwd`` delta is what it keeps for backward *including its output* (the next layer
  holds it); the net change of a layer over its forward and backward (``net``: its parameter
  gradients, plus the difference between its output and input sizes) does not depend on its mode.
- Time: the median over ``repeats`` interleaved steps per mode; layers of identical class,
  parameter shapes and input shape share their time samples (the median of the pooled samples);
  their memory is measured for each layer exactly. Without real hardware (`profile_meta`) time is
  *estimated* from FLOPs and memory traffic against a table of device peaks (`HARDWARE`), and the
  profile says so in ``time_source``.
- ``offload`` on CPU: the plugin runs such layers exactly as ``none`` (activations already live in
  host memory), so the profile copies ``none``'s costs rather than measuring noise twice. On the
  meta device the plugin cannot offload either, so the profile emulates
  `torch.autograd.graph.save_on_cpu` itself (every saved tensor leaves device memory in forward
  and comes back, as a new allocation, when backward unpacks it).
- ``selective`` works on the meta device (PyTorch's selective checkpointing only decides which op
  outputs to cache; it needs no data).
"""

from __future__ import annotations

import json
import math
import statistics
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from lightning_recompute import RecomputePolicy, applied_policy, apply_policy, find_layers, remove_policy
from lightning_recompute.errors import RecomputeError
from lightning_recompute.layers import LayerSpec
from lightning_recompute.meter import MemoryMeter, StorageMeter, memory_meter, synchronize
from lightning_recompute.policy import Mode
from tuner.units import format_bytes

__all__ = [
    "ALL_MODES",
    "HARDWARE",
    "Hardware",
    "LayerProfile",
    "Profile",
    "ProfileError",
    "SegmentCost",
    "profile_meta",
    "profile_model",
]

ALL_MODES: tuple[str, ...] = tuple(m.value for m in Mode)
PROFILE_VERSION = 1


class ProfileError(RecomputeError, ValueError):
    """The model, batch or options cannot be profiled as asked."""


# --------------------------------------------------------------------------- hardware table


@dataclass(frozen=True)
class Hardware:
    """Peak figures of one accelerator, for time estimates without the hardware."""

    name: str
    memory_bytes: int
    """Device memory as the driver reports it (nvidia-smi's total)."""
    flops: dict[str, float]
    """Dense peak FLOP/s per dtype name (``bfloat16``, ``float16``, ``float32``)."""
    hbm_bytes_per_s: float
    """Device memory bandwidth, for memory-bound (elementwise) ops."""
    host_bytes_per_s: float
    """Host link bandwidth (PCIe or C2C), for ``offload`` copies."""


_GIB = 1 << 30
_MIB = 1 << 20
HARDWARE: dict[str, Hardware] = {
    # Vendor datasheet dense peaks (no sparsity); fp32 is plain FP32 (PyTorch's default matmul
    # precision "highest" does not use TF32). Host: effective PCIe throughput for pinned copies.
    "A100": Hardware(
        "A100-SXM4-80GB", 81920 * _MIB, {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12}, 2.039e12, 25e9
    ),
    "H100": Hardware(
        "H100-SXM5-80GB", 81559 * _MIB, {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}, 3.35e12, 50e9
    ),
    "H200": Hardware(
        "H200-SXM-141GB", 143771 * _MIB, {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}, 4.8e12, 50e9
    ),
    "L4": Hardware("L4-24GB", 23034 * _MIB, {"bfloat16": 121e12, "float16": 121e12, "float32": 30.3e12}, 300e9, 25e9),
}
"""Device peaks used by `profile_meta`; keys are what ``hardware=`` accepts."""


# --------------------------------------------------------------------------- data model


@dataclass
class SegmentCost:
    """What one segment of the step costs."""

    delta: int = 0
    """Live device bytes at the segment's end minus at its start."""
    peak: int = 0
    """Highest live bytes during the segment minus the level at its start (>= 0)."""
    grad: int = 0
    """Bytes of parameter gradients allocated (or, negative, freed) in the segment."""
    seconds: float = 0.0
    """Time of the segment (measured median, or estimated; see `Profile.time_source`)."""
    flops: int = 0
    """FLOPs counted by `FlopCounterMode` (matmuls, attention kernels)."""
    traffic: int = 0
    """Bytes read and written by ops without a FLOP formula (elementwise, norms, copies)."""
    offload: int = 0
    """Bytes copied to host memory in this segment's forward and back in its backward (``offload``)."""
    scales: bool = True
    """Whether the activation part of this segment grows with the micro-batch (false for the optimizer)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SegmentCost:
        return cls(**d)


@dataclass
class LayerProfile:
    """One layer's costs, per mode."""

    name: str
    """Module path (``blocks.3``)."""
    group: str
    """Signature (class, parameter shapes, input shape): layers with the same group share time samples."""
    param_bytes: int
    fwd: dict[str, SegmentCost]
    """Per mode: the layer's forward (``delta`` = activation bytes kept for backward, output included)."""
    bwd: dict[str, SegmentCost]
    """Per mode: the layer's backward, recomputation included (``peak`` = the transient it adds)."""
    net: int
    """Bytes the layer's forward plus backward leave behind (gradients; output minus input); mode-independent."""

    def kept_bytes(self, mode: str) -> int:
        """Activation bytes kept from forward to backward (the layer's output included)."""
        return self.fwd[mode].delta

    def recompute_flops(self, mode: str) -> int:
        """FLOPs the backward spends beyond the backward under ``none``: the recomputation."""
        return max(0, self.bwd[mode].flops - self.bwd[Mode.NONE.value].flops) if Mode.NONE.value in self.bwd else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "group": self.group,
            "param_bytes": self.param_bytes,
            "net": self.net,
            "fwd": {m: c.to_dict() for m, c in self.fwd.items()},
            "bwd": {m: c.to_dict() for m, c in self.bwd.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerProfile:
        return cls(
            name=d["name"],
            group=d["group"],
            param_bytes=int(d["param_bytes"]),
            net=int(d["net"]),
            fwd={m: SegmentCost.from_dict(c) for m, c in d["fwd"].items()},
            bwd={m: SegmentCost.from_dict(c) for m, c in d["bwd"].items()},
        )


@dataclass
class Profile:
    """The cost profile of one training step of one model at one micro-batch; JSON-serialisable."""

    layers: list[LayerProfile]
    timeline: list[str]
    """Segment keys in execution order: ``fwd:<i>``, ``bwd:<i>`` (layer index) or ``fixed:<name>``."""
    fixed: dict[str, SegmentCost]
    """The segments no policy changes, by name (the keys of ``timeline`` without ``fixed:``)."""
    modes: list[str]
    base_bytes: int
    """Live device bytes when the step starts: parameters, optimizer state, the batch, buffers."""
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    batch_bytes: int
    micro_batch: int
    device: str
    time_source: str
    """``measured`` or ``estimated: ...`` (FLOPs and traffic against a hardware table)."""
    hardware: str | None = None
    groups: dict[str, list[str]] = field(default_factory=dict)
    """Layers sharing time measurements (see `LayerProfile.group`)."""
    notes: list[str] = field(default_factory=list)
    torch_version: str = torch.__version__
    version: int = PROFILE_VERSION

    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    @property
    def estimated(self) -> bool:
        return self.time_source != "measured"

    @property
    def fixed_activation_bytes(self) -> int:
        """Bytes the non-layer forward keeps (embedding outputs, logits, loss)."""
        first_bwd = next((i for i, k in enumerate(self.timeline) if k.startswith("bwd:")), len(self.timeline))
        keys = [k[len("fixed:") :] for k in self.timeline[:first_bwd] if k.startswith("fixed:")]
        return sum(self.fixed[k].delta - self.fixed[k].grad for k in keys)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "torch_version": self.torch_version,
            "device": self.device,
            "hardware": self.hardware,
            "time_source": self.time_source,
            "micro_batch": self.micro_batch,
            "modes": list(self.modes),
            "base_bytes": self.base_bytes,
            "param_bytes": self.param_bytes,
            "grad_bytes": self.grad_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "batch_bytes": self.batch_bytes,
            "timeline": list(self.timeline),
            "fixed": {k: c.to_dict() for k, c in self.fixed.items()},
            "layers": [layer.to_dict() for layer in self.layers],
            "groups": {k: list(v) for k, v in self.groups.items()},
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        if d.get("version") != PROFILE_VERSION:
            raise ProfileError(f"profile: unsupported version {d.get('version')!r}; valid: {PROFILE_VERSION}")
        return cls(
            layers=[LayerProfile.from_dict(x) for x in d["layers"]],
            timeline=list(d["timeline"]),
            fixed={k: SegmentCost.from_dict(c) for k, c in d["fixed"].items()},
            modes=list(d["modes"]),
            base_bytes=int(d["base_bytes"]),
            param_bytes=int(d["param_bytes"]),
            grad_bytes=int(d["grad_bytes"]),
            optimizer_bytes=int(d["optimizer_bytes"]),
            batch_bytes=int(d["batch_bytes"]),
            micro_batch=int(d["micro_batch"]),
            device=d["device"],
            time_source=d["time_source"],
            hardware=d.get("hardware"),
            groups={k: list(v) for k, v in d.get("groups", {}).items()},
            notes=list(d.get("notes", [])),
            torch_version=d.get("torch_version", ""),
            version=d["version"],
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        return cls.from_dict(json.loads(text))

    def describe(self) -> str:
        """A per-layer table of kept bytes, times and recomputed FLOPs per mode."""
        lines = [
            f"profile on {self.device} ({self.hardware or 'this machine'}), micro-batch {self.micro_batch}, time {self.time_source}",
            f"base {format_bytes(self.base_bytes)} = params {format_bytes(self.param_bytes)} + optimizer {format_bytes(self.optimizer_bytes)}"
            f" + batch {format_bytes(self.batch_bytes)} (+ buffers); gradients {format_bytes(self.grad_bytes)}",
        ]
        header = f"{'layer':<16}" + "".join(f"{m + ' kept':>16}{m + ' ms':>14}" for m in self.modes)
        lines.append(header)
        for layer in self.layers:
            row = f"{layer.name:<16}"
            for m in self.modes:
                row += f"{format_bytes(layer.fwd[m].delta):>16}{1e3 * (layer.fwd[m].seconds + layer.bwd[m].seconds):>14.3f}"
            lines.append(row)
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


# --------------------------------------------------------------------------- instruments


@dataclass
class _Event:
    label: str
    level: int
    peak: int  # highest level since the previous event
    grad: int  # bytes of parameter gradients alive
    time: float
    flops: int
    traffic: int
    offload: int


class _TrafficMode(TorchDispatchMode):
    """Bytes read and written by ops `FlopCounterMode` has no formula for: the memory-bound ones."""

    def __init__(self, registry: dict[Any, Any]) -> None:
        super().__init__()
        self.registry = registry
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in self.registry or any(r.alias_info is not None for r in func._schema.returns):
            return out  # compute-bound (counted as FLOPs), or a view: no traffic of its own
        flat, _ = tree_flatten((args, kwargs, out))
        self.total += sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
        return out


class _Offloaded:
    """What the meta-device ``offload`` emulation keeps of a saved tensor: its shape, not its memory."""

    __slots__ = ("device", "dtype", "size")

    def __init__(self, t: torch.Tensor) -> None:
        self.size, self.dtype, self.device = t.size(), t.dtype, t.device


class _Recorder:
    """Marks segment boundaries: layer hooks in forward, tensor hooks in backward."""

    def __init__(
        self,
        model: nn.Module,
        layers: list[tuple[str, nn.Module]],
        device: torch.device,
        meter: MemoryMeter | None,
        flops: FlopCounterMode | None,
        traffic: _TrafficMode | None,
        emulate_offload: frozenset[int] = frozenset(),
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.clock = clock
        self.params = [p for p in model.parameters()]
        self.layers = layers
        self.device = device
        self.meter = meter
        self.flops = flops
        self.traffic = traffic
        self.emulate_offload = emulate_offload
        self.events: list[_Event] = []
        self.input_shapes: dict[int, str] = {}
        self.offloaded = 0
        self._hooked: dict[int, tuple[weakref.ref[torch.Tensor], list[str]]] = {}
        self._handles: list[Any] = []
        self._offload_ctx: dict[int, Any] = {}

    def __enter__(self) -> _Recorder:
        for i, (_, module) in enumerate(self.layers):
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for ctx in self._offload_ctx.values():
            ctx.__exit__(None, None, None)
        self._offload_ctx.clear()

    def mark(self, label: str) -> None:
        if self.meter is not None:
            level, peak = self.meter.current_bytes, self.meter.peak_bytes
            self.meter.reset_peak()
        else:
            level = peak = 0
        if self.meter is None:
            synchronize(self.device)  # timing run: the clock must see queued device work
        seen: set[int] = set()
        grad = 0
        for p in self.params:
            g = p.grad
            if g is not None and g.device.type == self.device.type:
                key = g.untyped_storage()._cdata
                if key not in seen:
                    seen.add(key)
                    grad += g.untyped_storage().nbytes()
        self.events.append(
            _Event(
                label,
                level,
                peak,
                grad,
                self.clock(),
                self.flops.get_total_flops() if self.flops is not None else 0,
                self.traffic.total if self.traffic is not None else 0,
                self.offloaded,
            )
        )

    def _hook_tensor(self, t: torch.Tensor, label: str, first: bool) -> None:
        entry = self._hooked.get(id(t))
        if entry is not None and entry[0]() is t:
            # The same tensor is one layer's output and the next one's input: one hook, labels in
            # backward order (the later layer's backward ends, then the earlier one's starts).
            entry[1].insert(0, label) if first else entry[1].append(label)
            return
        labels = [label]
        self._hooked[id(t)] = (weakref.ref(t), labels)

        def hook(_grad: torch.Tensor) -> None:
            for lab in labels:
                self.mark(lab)

        t.register_hook(hook)

    def _pre_hook(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not torch.is_grad_enabled():
                return
            self.mark(f"fwd_start:{i}")
            t = _first_grad_tensor((args, kwargs))
            if t is not None:
                self.input_shapes[i] = f"{tuple(t.shape)}:{t.dtype}"
                self._hook_tensor(t, f"bwd_end:{i}", first=True)
            if i in self.emulate_offload:
                ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                ctx.__enter__()
                self._offload_ctx[i] = ctx

        return hook

    def _post_hook(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            ctx = self._offload_ctx.pop(i, None)
            if ctx is not None:
                ctx.__exit__(None, None, None)
            self.mark(f"fwd_end:{i}")
            t = _first_grad_tensor(output)
            if t is not None:
                self._hook_tensor(t, f"bwd_start:{i}", first=False)

        return hook

    # torch.autograd.graph.save_on_cpu, minus the host copy: the device forgets the tensor in
    # forward and allocates it anew when backward unpacks it.
    def _pack(self, t: torch.Tensor) -> Any:
        if t.device.type != self.device.type:
            return t
        self.offloaded += t.numel() * t.element_size()
        return _Offloaded(t)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        self.offloaded += math.prod(packed.size) * torch.empty((), dtype=packed.dtype).element_size()
        return torch.empty(packed.size, dtype=packed.dtype, device=packed.device)


def _first_grad_tensor(obj: Any) -> torch.Tensor | None:
    flat, _ = tree_flatten(obj)
    for v in flat:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            return v
    return None


# --------------------------------------------------------------------------- the step


LossFn = Callable[[nn.Module, Any], torch.Tensor]


def _default_loss_fn(model: nn.Module) -> LossFn:
    """``training_step`` for a LightningModule; ``model.loss(batch)`` if it has one; else ``model(batch)``."""
    try:
        import lightning as L

        is_lightning = isinstance(model, L.LightningModule)
    except ImportError:  # pragma: no cover - lightning is a dependency
        is_lightning = False
    if is_lightning:
        if not model.automatic_optimization:
            raise ProfileError(
                f"model: {type(model).__name__} uses manual optimization; pass loss_fn=(model, batch) -> loss to profile it"
            )

        def lightning_step(m: nn.Module, batch: Any) -> torch.Tensor:
            with warnings.catch_warnings():
                # self.log without a Trainer warns on every call; the profile does not need the logs.
                warnings.filterwarnings("ignore", message=".*self.log.*")
                out = m.training_step(batch, 0)
            return out["loss"] if isinstance(out, dict) else out

        return lightning_step
    if callable(getattr(model, "loss", None)):
        return lambda m, batch: m.loss(batch)
    return lambda m, batch: m(batch)


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
    if callable(configure):
        out = configure()
        found = _find_optimizer(out)
        if found is not None:
            return found
        raise ProfileError(
            f"optimizer: {type(model).__name__}.configure_optimizers() returned {type(out).__name__}, "
            f"in which no torch.optim.Optimizer was found; pass optimizer= explicitly"
        )
    notes.append("optimizer: none given and the model has no configure_optimizers; profiled with AdamW")
    return torch.optim.AdamW(model.parameters())


def _find_optimizer(out: Any) -> torch.optim.Optimizer | None:
    if isinstance(out, torch.optim.Optimizer):
        return out
    if isinstance(out, dict):
        return _find_optimizer(out.get("optimizer"))
    if isinstance(out, (list, tuple)):
        for item in out:
            found = _find_optimizer(item)
            if found is not None:
                return found
    return None


def _run_step(
    model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer, rec: _Recorder | None
) -> None:
    mark = rec.mark if rec is not None else (lambda label: None)
    mark("step")
    loss = loss_fn(model, batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ProfileError(
            f"loss_fn: must return a scalar loss tensor, got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )
    mark("loss")
    # Lightning's automatic optimisation zeroes gradients after training_step and before
    # backward, so the previous step's gradients are alive through the whole forward.
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    del loss
    mark("backward")
    optimizer.step()
    mark("optimizer")


def _segments(events: list[_Event], n_layers: int) -> list[tuple[str, list[_Event]]]:
    """Cut the events into keyed segments (see the module docstring); each with its events, ends included."""
    out: list[tuple[str, list[_Event]]] = []
    k = 0
    while k < len(events) - 1:
        kind, _, idx = events[k].label.partition(":")
        end = k + 1
        if kind == "fwd_start":
            # The gap after a layer's forward belongs to it: a layer that does not keep its input
            # (offload) lets it go there, when the caller drops its last reference.
            if (
                events[end].label == f"fwd_end:{idx}"
                and end + 1 < len(events)
                and events[end + 1].label.startswith("fwd_start:")
            ):
                end += 1
            key = f"fwd:{idx}"
        elif kind == "bwd_start":
            key = f"bwd:{idx}"
        else:
            key = f"fixed:{events[k].label}->{events[end].label}"
        out.append((key, events[k : end + 1]))
        k = end
    seen = [key for key, _ in out if not key.startswith("fixed:")]
    expected = [f"fwd:{i}" for i in range(n_layers)] + [f"bwd:{i}" for i in reversed(range(n_layers))]
    if seen != expected:
        raise ProfileError(
            "the step did not run each layer once in order with backward in reverse order "
            f"(segments seen: {seen[:8]}{' ...' if len(seen) > 8 else ''}); the planner models a stack of layers "
            "each called once per step. Choose layers= that the model calls exactly once each"
        )
    return out


def _cost(events: list[_Event], scales: bool) -> SegmentCost:
    a, b = events[0], events[-1]
    return SegmentCost(
        delta=b.level - a.level,
        peak=max(0, max(e.peak for e in events[1:]) - a.level),
        grad=b.grad - a.grad,
        seconds=b.time - a.time,
        flops=b.flops - a.flops,
        traffic=b.traffic - a.traffic,
        offload=b.offload - a.offload,
        scales=scales,
    )


# --------------------------------------------------------------------------- profiling


def _storage_bytes(tensors: Iterable[torch.Tensor], device_type: str) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == device_type:
            s = t.untyped_storage()
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def _batch_size(batch: Any) -> int:
    flat, _ = tree_flatten(batch)
    for v in flat:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
    raise ProfileError("batch: found no tensor with a batch dimension in the batch")


def _check_modes(modes: Sequence[str] | None, device: torch.device) -> list[str]:
    if modes is None:
        return list(ALL_MODES)
    out = []
    for m in modes:
        try:
            out.append(Mode(str(m).strip().lower()).value)
        except ValueError:
            raise ProfileError(f"modes: unknown mode {m!r}; valid modes are: {', '.join(ALL_MODES)}") from None
    if not out:
        raise ProfileError(f"modes: empty; valid modes are: {', '.join(ALL_MODES)}")
    if Mode.NONE.value not in out:
        out.insert(0, Mode.NONE.value)  # the reference every recomputation is measured against
    return list(dict.fromkeys(out))


def _group_of(name: str, module: nn.Module, input_shape: str) -> str:
    params = ",".join(f"{n}{tuple(p.shape)}:{str(p.dtype)[6:]}" for n, p in module.named_parameters())
    return f"{type(module).__qualname__}[{params}]<-{input_shape}"


class _Session:
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
    ) -> None:
        self.model, self.batch, self.layer_spec, self.modes, self.device = model, batch, layers, modes, device
        self.notes: list[str] = []
        self.layers = find_layers(model, layers)
        self.names = [n for n, _ in self.layers]
        self.loss_fn = loss_fn or _default_loss_fn(model)
        self.optimizer = _make_optimizer(model, optimizer, self.notes)

    def apply(self, mode: str) -> None:
        with warnings.catch_warnings():
            # The plugin warns that offload does nothing off CUDA; the profile already says so.
            warnings.filterwarnings("ignore", message=".*offload.*")
            apply_policy(self.model, RecomputePolicy.uniform(mode), self.layer_spec)

    def memory_run(self, mode: str, emulate_offload: bool) -> _Recorder:
        """Two steps with every layer in ``mode``: one under the memory meter and the traffic counter,
        one under `FlopCounterMode`; the returned events carry the memory of the first, the FLOPs of the second.

        Apart because FlopCounterMode's module tracker keeps tensors recomputed in backward alive
        past their use (hundreds of KiB per layer on the reference model), which the meter would see.
        """
        self.apply(Mode.NONE.value if emulate_offload else mode)
        offload = frozenset(range(len(self.layers))) if emulate_offload else frozenset()
        meter = memory_meter(self.device)
        meter.track(self.model, self.optimizer, self.batch)
        traffic = _TrafficMode(FlopCounterMode(display=False).flop_registry)
        with _Recorder(self.model, self.layers, self.device, meter, None, traffic, offload) as rec:
            with meter, traffic:
                _run_step(self.model, self.batch, self.loss_fn, self.optimizer, rec)
        if isinstance(meter, StorageMeter):
            meter.close()  # detach its finalizers from storages that outlive the step (parameters)
        counter = FlopCounterMode(display=False)
        with _Recorder(self.model, self.layers, self.device, None, counter, None, offload) as frec, counter:
            _run_step(self.model, self.batch, self.loss_fn, self.optimizer, frec)
        if [e.label for e in frec.events] != [e.label for e in rec.events]:
            raise ProfileError(
                f"mode {mode}: two identical steps ran different layer sequences; the model's control flow varies"
            )
        for e, f in zip(rec.events, frec.events):
            e.flops = f.flops
        return rec

    def warm_up(self) -> None:
        """One plain step: creates the optimizer state, so the measured steps see it in the base."""
        self.apply(Mode.NONE.value)
        _run_step(self.model, self.batch, self.loss_fn, self.optimizer, None)

    def build(
        self,
        mem: dict[str, _Recorder],
        times: dict[str, list[dict[str, float]]] | None,
        time_source: str,
        hardware: str | None,
        estimate: Callable[[SegmentCost], float] | None,
    ) -> Profile:
        n = len(self.layers)
        segs = {m: _segments(rec.events, n) for m, rec in mem.items()}
        keys = [k for k, _ in segs[Mode.NONE.value]]
        for m, s in segs.items():
            if [k for k, _ in s] != keys:
                raise ProfileError(
                    f"the step's structure differs between mode none and mode {m} "
                    f"({len(keys)} vs {len(s)} segments); the model must call the same layers in the same order"
                )
        by_mode = {m: {k: _cost(ev, scales=k != "fixed:backward->optimizer") for k, ev in s} for m, s in segs.items()}
        none = by_mode[Mode.NONE.value]
        rec0 = mem[Mode.NONE.value]
        groups: dict[str, list[str]] = {}
        layer_profiles: list[LayerProfile] = []
        for i, (name, module) in enumerate(self.layers):
            group = _group_of(name, module, rec0.input_shapes.get(i, "?"))
            groups.setdefault(group, []).append(name)
            fwd = {m: by_mode[m][f"fwd:{i}"] for m in self.modes}
            bwd = {m: by_mode[m][f"bwd:{i}"] for m in self.modes}
            nets = {m: fwd[m].delta + bwd[m].delta for m in self.modes}
            net = nets[Mode.NONE.value]
            spread = max(nets.values()) - min(nets.values())
            if spread > max(1024, 0.01 * abs(fwd[Mode.NONE.value].delta)):
                self.notes.append(
                    f"{name}: forward+backward leaves {spread} bytes more in some mode than in another "
                    f"({nets}); the planner uses mode none's {net}"
                )
            param_bytes = _storage_bytes(module.parameters(), self.device.type)
            layer_profiles.append(LayerProfile(name, group, param_bytes, fwd, bwd, net))
        fixed = {k[len("fixed:") :]: c for k, c in none.items() if k.startswith("fixed:")}
        if times is not None:
            self._assign_times(layer_profiles, fixed, times, groups)
        elif estimate is not None:
            for lp in layer_profiles:
                for c in (*lp.fwd.values(), *lp.bwd.values()):
                    c.seconds = estimate(c)
            for c in fixed.values():
                c.seconds = estimate(c)
        shared = [g for g in groups.values() if len(g) > 1]
        if shared and times is not None:
            self.notes.append(
                "time: layers of identical class, parameter shapes and input shape share their time samples "
                f"(median of the pooled samples): {'; '.join(_span(g) for g in shared)}; memory is per layer"
            )
        return Profile(
            layers=layer_profiles,
            timeline=keys,
            fixed=fixed,
            modes=list(self.modes),
            base_bytes=rec0.events[0].level,
            param_bytes=_storage_bytes(self.model.parameters(), self.device.type),
            # A gradient is the size of its parameter. (Summing per-segment growth would miss the
            # head's: its gradients appear in the segment where zero_grad frees the old ones.)
            grad_bytes=_storage_bytes((p for p in self.model.parameters() if p.requires_grad), self.device.type),
            optimizer_bytes=_storage_bytes(
                (v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
                self.device.type,
            ),
            batch_bytes=_storage_bytes(tree_flatten(self.batch)[0], self.device.type),
            micro_batch=_batch_size(self.batch),
            device=str(self.device),
            time_source=time_source,
            hardware=hardware,
            groups=groups,
            notes=self.notes,
        )

    def _assign_times(
        self,
        layers: list[LayerProfile],
        fixed: dict[str, SegmentCost],
        times: dict[str, list[dict[str, float]]],
        groups: dict[str, list[str]],
    ) -> None:
        index = {lp.name: i for i, lp in enumerate(layers)}
        for mode, runs in times.items():
            for members in groups.values():
                for phase in ("fwd", "bwd"):
                    samples = [run[f"{phase}:{index[name]}"] for run in runs for name in members]
                    med = statistics.median(samples)
                    for name in members:
                        getattr(layers[index[name]], phase)[mode].seconds = med
        runs_none = times[Mode.NONE.value]
        for key, cost in fixed.items():
            cost.seconds = statistics.median(run[f"fixed:{key}"] for run in runs_none)
        # Offload on CPU is none (see the module docstring): same times, not a second noisy sample.
        for lp in layers:
            for phase in ("fwd", "bwd"):
                costs = getattr(lp, phase)
                if Mode.OFFLOAD.value in costs and Mode.OFFLOAD.value not in times:
                    costs[Mode.OFFLOAD.value].seconds = costs[Mode.NONE.value].seconds


def _span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"


def profile_model(
    model: nn.Module,
    batch: Any,
    layers: LayerSpec = "auto",
    *,
    modes: Sequence[str] | None = None,
    optimizer: torch.optim.Optimizer | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    loss_fn: LossFn | None = None,
    repeats: int = 5,
    restore: bool = True,
    clock: Callable[[], float] = time.perf_counter,
) -> Profile:
    """Measure the per-layer, per-mode costs of a training step of ``model`` on ``batch``.

    Runs one warm-up step, one step per mode under the memory meter, FLOP counter and traffic
    counter, then ``repeats`` timed rounds (every mode once per round, in rotating order). The
    device is the one the model's parameters are on; the batch is moved there.

    Args:
        model: an ``nn.Module`` or LightningModule (its ``training_step`` and
            ``configure_optimizers`` are used unless ``loss_fn`` / ``optimizer`` are given).
        batch: one micro-batch, as the training step receives it.
        layers: which modules are layers (see `lightning_recompute.layers.LayerSpec`).
        modes: the modes to profile (default: all four); ``none`` is always included.
        optimizer: an optimizer over ``model``'s parameters, or a factory ``params -> optimizer``.
        loss_fn: ``(model, batch) -> scalar loss``.
        repeats: timed steps per mode (>= 1); the medians are kept.
        restore: put the parameters (and buffers) back as they were afterwards (the profiled
            steps train the model); needs a host copy of the ``state_dict``. A given
            ``optimizer``'s state does advance.
        clock: the timer (wall clock by default, with a device synchronize at every boundary).
            On a shared CPU machine, ``time.thread_time`` with ``torch.set_num_threads(1)``
            measures the work of the step rather than the other tenants' load.

    Raises:
        ProfileError: bad arguments, or a model whose layers do not run once each in order.
        LayerDiscoveryError: ``layers`` found nothing.
    """
    if not isinstance(model, nn.Module):
        raise ProfileError(f"model: expected an nn.Module, got {type(model).__name__}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ProfileError(f"repeats: must be a positive integer, got {repeats!r}")
    if not callable(clock):
        raise ProfileError(f"clock: expected a callable returning seconds (time.perf_counter), got {clock!r}")
    param = next(model.parameters(), None)
    if param is None:
        raise ProfileError(f"model: {type(model).__name__} has no parameters; nothing to train, nothing to profile")
    device = param.device
    if device.type == "meta":
        raise ProfileError(
            "model: its parameters are on the meta device; use profile_meta(model_factory, batch) to plan without memory"
        )
    mode_list = _check_modes(modes, device)
    batch = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)
    previous = applied_policy(model)
    snapshot = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()} if restore else None
    was_training = model.training
    model.train()
    try:
        session = _Session(model, batch, layers, mode_list, optimizer, loss_fn, device)
        session.warm_up()
        # On CPU offload is none (see the module docstring): measure it once, as none.
        measured = [m for m in mode_list if not (m == Mode.OFFLOAD.value and device.type != "cuda")]
        if len(measured) < len(mode_list):
            session.notes.append("offload: the plugin runs it as none on this device; its costs are none's")
        mem: dict[str, _Recorder] = {}
        for m in measured:
            mem[m] = session.memory_run(m, emulate_offload=False)
        for m in mode_list:
            mem.setdefault(m, mem[Mode.NONE.value])
        times: dict[str, list[dict[str, float]]] = {m: [] for m in measured}
        for r in range(repeats + 1):  # round 0 warms each mode's code paths up; it is not kept
            order = measured[r % len(measured) :] + measured[: r % len(measured)]
            for m in order:
                session.apply(m)
                with _Recorder(model, session.layers, device, None, None, None, clock=clock) as rec:
                    _run_step(model, batch, session.loss_fn, session.optimizer, rec)
                if r > 0:
                    times[m].append(
                        {k: ev[-1].time - ev[0].time for k, ev in _segments(rec.events, len(session.layers))}
                    )
        return session.build(mem, times, "measured", None, None)
    finally:
        remove_policy(model)
        if previous is not None:
            apply_policy(model, previous.policy, layers)
        if snapshot is not None:
            model.load_state_dict(snapshot)
        model.train(was_training)


def profile_meta(
    model_factory: Callable[[], nn.Module],
    batch: Any,
    layers: LayerSpec = "auto",
    *,
    modes: Sequence[str] | None = None,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    loss_fn: LossFn | None = None,
    hardware: str = "H100",
    mfu: float = 0.5,
    bandwidth_efficiency: float = 0.7,
) -> Profile:
    """The memory profile of a training step computed on the meta device: no tensor is allocated.

    ``model_factory`` is called under ``torch.device("meta")``, so a model of any size costs
    nothing; ``batch`` tensors are replaced by meta tensors of the same shape and dtype. Memory
    and FLOPs are exact for the ops as dispatched (a fused attention kernel is only modelled if
    the model calls one on meta, as `tuner.models.LlamaLike` does). Time is an *estimate*:
    ``flops / (peak * mfu) + traffic / (hbm bandwidth * bandwidth_efficiency)`` per segment, plus
    host copies for ``offload``, with the peaks of ``HARDWARE[hardware]``.

    Args:
        model_factory: builds the model (called once, on meta).
        batch: one micro-batch (tensors of any device; only shapes and dtypes are used).
        layers: which modules are layers.
        modes: modes to profile (default: all four).
        optimizer: factory ``params -> optimizer`` (default: the model's ``configure_optimizers``, else AdamW).
        loss_fn: ``(model, batch) -> scalar loss``.
        hardware: a key of `HARDWARE` (``A100``, ``H100``, ``H200``, ``L4``).
        mfu: fraction of peak FLOP/s matmuls reach (0 < mfu <= 1).
        bandwidth_efficiency: fraction of peak memory bandwidth elementwise ops reach.
    """
    if hardware not in HARDWARE:
        raise ProfileError(f"hardware: unknown {hardware!r}; valid: {', '.join(HARDWARE)}")
    for name, value in (("mfu", mfu), ("bandwidth_efficiency", bandwidth_efficiency)):
        if not (isinstance(value, (int, float)) and 0 < value <= 1):
            raise ProfileError(f"{name}: must be in (0, 1], got {value!r}")
    if not callable(model_factory):
        raise ProfileError(
            f"model_factory: expected a callable returning an nn.Module, got {type(model_factory).__name__}"
        )
    device = torch.device("meta")
    with device:
        model = model_factory()
    if not isinstance(model, nn.Module):
        raise ProfileError(f"model_factory: returned {type(model).__name__}, not an nn.Module")
    elsewhere = sorted({p.device.type for p in model.parameters()} - {"meta"})
    if elsewhere:
        raise ProfileError(
            f"model_factory: built parameters on {elsewhere}, not on meta; do not pass device= to the layers it builds"
        )
    mode_list = _check_modes(modes, device)
    batch = tree_map(lambda t: torch.empty_like(t, device=device) if isinstance(t, torch.Tensor) else t, batch)
    model.train()
    hw = HARDWARE[hardware]
    dtypes = [p.dtype for p in model.parameters()]
    dtype = max(set(dtypes), key=dtypes.count)
    peak = hw.flops.get(str(dtype).replace("torch.", ""), hw.flops["float32"])

    def estimate(c: SegmentCost) -> float:
        return (
            c.flops / (peak * mfu)
            + c.traffic / (hw.hbm_bytes_per_s * bandwidth_efficiency)
            + c.offload / hw.host_bytes_per_s
        )

    session = _Session(model, batch, layers, mode_list, optimizer, loss_fn, device)
    session.warm_up()
    mem: dict[str, _Recorder] = {}
    for m in mode_list:
        mem[m] = session.memory_run(m, emulate_offload=(m == Mode.OFFLOAD.value))
    remove_policy(model)
    source = (
        f"estimated: FLOPs / ({hw.name} {str(dtype)[6:]} peak x mfu {mfu}) + traffic / (HBM x {bandwidth_efficiency})"
    )
    prof = session.build(mem, None, source, hardware, estimate)
    if Mode.OFFLOAD.value in mode_list:
        prof.notes.append(
            "offload: emulated on meta (saved tensors leave device memory in forward, return in backward)"
        )
    return prof
