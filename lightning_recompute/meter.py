"""Peak-memory and step-time meters with one interface for CUDA (the allocator's statistics), CPU and meta
(`StorageMeter`, an exact ledger of live storages; ``RECOMPUTE_CPU_MEMORY_LIMIT`` caps it as a GPU's memory would).
"""

from __future__ import annotations

import os
import weakref
from time import perf_counter
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

CPU_MEMORY_LIMIT = "RECOMPUTE_CPU_MEMORY_LIMIT"  # the environment variable that caps the CPU's metered steps


def cpu_memory_limit() -> int | None:
    """The CPU cap in bytes from `CPU_MEMORY_LIMIT`, or ``None`` when unset or empty; a `ValueError` if not a size."""
    from lightning_recompute.units import parse_bytes

    raw = os.environ.get(CPU_MEMORY_LIMIT, "").strip()
    try:
        return parse_bytes(raw) if raw else None
    except ValueError as err:
        raise ValueError(f"{CPU_MEMORY_LIMIT}: {err}") from None


class MemoryMeter:
    """Current and peak bytes of tensor memory on one device, measured from `start` (which resets the peak)."""

    device: torch.device

    def __enter__(self) -> MemoryMeter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.reset_peak()

    def stop(self) -> None:  # readings stay available
        pass

    def reset_peak(self) -> None:
        raise NotImplementedError

    def track(self, *objs: Any) -> None:  # count tensors from before `start` (meters that see everything need not)
        pass

    @property
    def current_bytes(self) -> int:
        raise NotImplementedError

    @property
    def peak_bytes(self) -> int:
        raise NotImplementedError


class CudaMemoryMeter(MemoryMeter):
    """The CUDA caching allocator's own statistics (``memory_allocated``, ``max_memory_allocated``)."""

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        self.device = torch.device("cuda" if device is None else device)
        if self.device.type == "cuda" and self.device.index is None:  # fixed now: the current GPU may change
            self.device = torch.device("cuda", torch.cuda.current_device())

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def current_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    @property
    def peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))


class StorageMeter(MemoryMeter):
    """Live tensor storage bytes, exactly: fresh op outputs on, freed storages off, FSDP2's ``resize_`` watched."""

    def __init__(self, device: torch.device | str = "cpu", *, limit: int | None = None) -> None:
        self.device = torch.device(device)
        self.limit = cpu_memory_limit() if limit is None and self.device.type == "cpu" else limit
        self.live: dict[int, int] = {}  # storage (its StorageImpl's address, shared by its views) -> bytes
        self._current = self._peak = 0
        self._finalizers: dict[int, weakref.finalize] = {}
        self._mode: _LedgerMode | None = None

    def start(self) -> None:
        if self._mode is not None:
            raise RuntimeError("StorageMeter is already started")
        self._mode = _LedgerMode(self)
        self._mode.__enter__()
        _ResizeWatch.add(self)
        self.reset_peak()

    def stop(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            _ResizeWatch.remove(self)
            mode.__exit__(None, None, None)

    def close(self) -> None:
        """Stop, and forget every storage still on the ledger."""
        self.stop()
        for fin in self._finalizers.values():
            fin.detach()
        self._finalizers.clear()
        self.live.clear()
        self._current = self._peak = 0

    def reset_peak(self) -> None:
        self._peak = self._current

    def track(self, *objs: Any) -> None:
        for obj in objs:
            for t in _tensors_of(obj):
                self.add(t, allocated=False)

    @property
    def current_bytes(self) -> int:
        return self._current

    @property
    def peak_bytes(self) -> int:
        return self._peak

    def add(self, tensor: torch.Tensor, *, allocated: bool = True) -> None:
        """Put ``tensor``'s storage on the ledger; ``allocated``: it was just allocated (the limit applies)."""
        if is_traceable_wrapper_subclass(tensor):
            for attr in tensor.__tensor_flatten__()[0]:
                inner = getattr(tensor, attr)
                if isinstance(inner, torch.Tensor):
                    self.add(inner, allocated=allocated)
            return
        if tensor.device.type != self.device.type or tensor.is_sparse or tensor.layout != torch.strided:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a storage (some subclasses)
            return
        if storage._cdata not in self.live:
            self._set(storage, check=allocated)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` was resized in place: a known one changes size, an unknown one grown from 0 is new."""
        known = self.live.get(storage._cdata)
        if storage.device.type == self.device.type and (known is not None or storage.nbytes() > 0):
            # A shrink (FSDP2 freeing an unsharded parameter) never runs out of memory.
            self._set(storage, check=storage.nbytes() > (known or 0))

    def _set(self, storage: torch.UntypedStorage, *, check: bool) -> None:
        key, nbytes = storage._cdata, int(storage.nbytes())
        if key not in self.live:
            self._finalizers[key] = weakref.finalize(storage, self._free, key)
        grown = nbytes - self.live.get(key, 0)
        self.live[key] = nbytes
        self._current += grown
        self._peak = max(self._peak, self._current)
        if check and self.limit is not None and self._current > self.limit:
            raise torch.OutOfMemoryError(
                f"{self.device.type.upper()} out of memory: tried to allocate {grown} bytes with "
                f"{self._current - grown} live, over the limit of {self.limit} bytes ({CPU_MEMORY_LIMIT})"
            )

    def _free(self, key: int) -> None:
        self._finalizers.pop(key, None)
        self._current -= self.live.pop(key, 0)


class _LedgerMode(TorchDispatchMode):
    def __init__(self, meter: StorageMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # An output aliasing an input (views, in-place and out= ops) is not new memory.
        if not any(r.alias_info is not None for r in func._schema.returns):
            for value in tree_flatten(out)[0]:
                if isinstance(value, torch.Tensor):
                    self.meter.add(value)
        return out


class _ResizeWatch:
    """Reports in-place storage resizes (FSDP2's ``resize_`` reaches no dispatch mode) to the started meters."""

    meters: ClassVar[list[StorageMeter]] = []
    original: ClassVar[Any] = None

    @classmethod
    def add(cls, meter: StorageMeter) -> None:
        if not cls.meters:
            cls.original = original = torch.UntypedStorage.resize_

            def resize_(storage: torch.UntypedStorage, size: int) -> Any:
                out = original(storage, size)
                for each in cls.meters:
                    each.resized(storage)
                return out

            setattr(torch.UntypedStorage, "resize_", resize_)  # noqa: B010 - restored in remove()
        cls.meters.append(meter)

    @classmethod
    def remove(cls, meter: StorageMeter) -> None:
        if meter in cls.meters:
            cls.meters.remove(meter)
            if not cls.meters:
                setattr(torch.UntypedStorage, "resize_", cls.original)  # noqa: B010
                cls.original = None


def _tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, nn.Module):
        obj = [*obj.parameters(), *(p.grad for p in obj.parameters()), *obj.buffers()]
    elif isinstance(obj, torch.optim.Optimizer):
        obj = list(obj.state.values())
    return [v for v in tree_flatten(obj)[0] if isinstance(v, torch.Tensor)]


def memory_meter(device: torch.device | str) -> MemoryMeter:
    """The meter for ``device``: allocator statistics on CUDA, the storage ledger on CPU and meta."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return CudaMemoryMeter(dev)
    if dev.type in ("cpu", "meta"):
        return StorageMeter(dev)
    raise ValueError(f"device: no memory meter for device type {dev.type!r}; valid: cuda, cpu, meta")


def synchronize(device: torch.device | str) -> None:
    """Wait for queued device work, so a wall-clock reading covers it (a no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Duration of one step, device work included: wall-clock on CPU, CUDA events on a GPU (docs/GPU.md)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._start: Any = None  # a perf_counter reading, or a recorded CUDA event

    def start(self) -> None:
        synchronize(self.device)
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = perf_counter()

    def stop(self) -> float | None:
        """Seconds since `start`, or ``None`` if it was not started."""
        start, self._start = self._start, None
        if start is None:
            return None
        if isinstance(start, float):
            return perf_counter() - start
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds
