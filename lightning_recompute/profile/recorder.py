"""Instruments of one profiled step: the event recorder, memory-traffic counting, and emulated offload on meta."""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from lightning_recompute.meter import MemoryMeter, synchronize


@dataclass
class Event:
    """One marked boundary of a profiled step: the memory level and counters at that point."""

    label: str
    level: int
    peak: int  # highest level since the previous event
    grad: int  # bytes of parameter gradients alive
    time: float
    flops: int
    traffic: int
    offload: int


class TrafficMode(TorchDispatchMode):
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


class Recorder:
    """Marks segment boundaries: layer hooks in forward, tensor hooks in backward."""

    def __init__(
        self,
        model: nn.Module,
        layers: list[tuple[str, nn.Module]],
        device: torch.device,
        meter: MemoryMeter | None,
        flops: FlopCounterMode | None,
        traffic: TrafficMode | None,
        emulate_offload: frozenset[int] = frozenset(),
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.clock = clock
        self.model = model
        self.params = [p for p in model.parameters()]
        self.layers = layers
        self.device = device
        self.meter = meter
        self.flops = flops
        self.traffic = traffic
        self.emulate_offload = emulate_offload
        self.events: list[Event] = []
        self.input_shapes: dict[int, str] = {}
        self.offloaded = 0
        self._hooked: dict[int, tuple[weakref.ref[torch.Tensor], list[str]]] = {}
        self._handles: list[Any] = []
        self._offload_ctx: dict[int, Any] = {}

    def __enter__(self) -> Recorder:
        for i, (_, module) in enumerate(self.layers):
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(i), with_kwargs=True))
        # The end of the model's forward: where FSDP2's root frees the last layer's all-gather buffer.
        self._handles.append(self.model.register_forward_hook(self._output_hook))
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
            Event(
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
            # One layer's output is the next one's input: one hook, labels in backward order.
            entry[1].insert(0, label) if first else entry[1].append(label)
            return
        labels = [label]
        self._hooked[id(t)] = (weakref.ref(t), labels)

        def hook(_grad: torch.Tensor) -> None:
            for lab in labels:
                self.mark(lab)

        t.register_hook(hook)

    def _output_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and not any(e.label == "output" for e in self.events):
            self.mark("output")

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

    # save_on_cpu minus the host copy: forgotten in forward, allocated anew when backward unpacks it.
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
