"""Peak-memory and step-time meters with one interface for CUDA, CPU and the meta device.

On CUDA the allocator's statistics; on CPU and meta `StorageMeter`, an exact ledger of live storages
(a dispatch mode records fresh outputs, a ``weakref.finalize`` takes them off; DTensors count their inner
tensors, and in-place ``UntypedStorage.resize_``, which FSDP2 uses, is watched). ``RECOMPUTE_CPU_MEMORY_LIMIT``
caps a started CPU meter: an allocation over it raises ``torch.OutOfMemoryError``, as on CUDA.
"""

from __future__ import annotations

import os
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterable
from time import perf_counter
from types import TracebackType
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

__all__ = [
    "CPU_MEMORY_LIMIT",
    "CudaMemoryMeter",
    "MemoryMeter",
    "StepTimer",
    "StorageMeter",
    "cpu_memory_limit",
    "memory_meter",
    "synchronize",
]

CPU_MEMORY_LIMIT = "RECOMPUTE_CPU_MEMORY_LIMIT"
"""The environment variable that caps the CPU device's metered steps."""


def cpu_memory_limit() -> int | None:
    """The CPU cap in bytes from `CPU_MEMORY_LIMIT`, or ``None`` when unset or empty.

    Raises:
        ValueError: the variable is not a size.
    """
    from lightning_recompute.units import parse_bytes

    raw = os.environ.get(CPU_MEMORY_LIMIT, "").strip()
    if not raw:
        return None
    try:
        return parse_bytes(raw)
    except ValueError as err:
        raise ValueError(f"{CPU_MEMORY_LIMIT}: {err}") from None


class MemoryMeter(ABC):
    """Current and peak bytes of tensor memory on one device while the meter is entered."""

    device: torch.device

    def __enter__(self) -> MemoryMeter:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @abstractmethod
    def start(self) -> None:
        """Begin measuring; the peak starts at the current level."""

    @abstractmethod
    def stop(self) -> None:
        """Stop measuring (readings stay available)."""

    @abstractmethod
    def reset_peak(self) -> None:
        """Make the peak equal to the current level (call at the start of each step)."""

    @property
    @abstractmethod
    def current_bytes(self) -> int:
        """Bytes of live tensor memory now."""

    @property
    @abstractmethod
    def peak_bytes(self) -> int:
        """Highest ``current_bytes`` since `start` or the last `reset_peak`."""

    def track(self, *objs: Any) -> None:
        """Count tensors that existed before the meter started (a no-op for meters that see everything)."""
        return None


class CudaMemoryMeter(MemoryMeter):
    """The CUDA caching allocator's own statistics (``memory_allocated``, ``max_memory_allocated``)."""

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    def start(self) -> None:
        self.reset_peak()

    def stop(self) -> None:
        pass

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def current_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    @property
    def peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))


class _Ledger:
    """Live storages by identity, with running current and peak totals."""

    def __init__(self, device_type: str, limit: int | None = None) -> None:
        self.device_type = device_type
        self.limit = limit
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self._finalizers: dict[int, weakref.finalize] = {}

    def add(self, tensor: torch.Tensor, *, allocated: bool = True) -> None:
        """Put ``tensor``'s storage on the ledger; ``allocated``: it was just allocated (the limit applies)."""
        if is_traceable_wrapper_subclass(tensor):
            attrs, _ = tensor.__tensor_flatten__()
            for attr in attrs:
                inner = getattr(tensor, attr)
                if isinstance(inner, torch.Tensor):
                    self.add(inner, allocated=allocated)
            return
        if tensor.device.type != self.device_type or tensor.is_sparse or tensor.layout != torch.strided:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a storage (some subclasses)
            return
        key = storage._cdata  # the StorageImpl's address: one key per storage, shared by all its views
        if key in self.live:
            return
        nbytes = int(storage.nbytes())
        self.live[key] = nbytes
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
        self._finalizers[key] = weakref.finalize(storage, self._free, key)
        if allocated:
            self._check(nbytes)

    def _check(self, nbytes: int) -> None:
        if self.limit is not None and self.current > self.limit:
            raise torch.OutOfMemoryError(
                f"{self.device_type.upper()} out of memory: tried to allocate {nbytes} bytes with "
                f"{self.current - nbytes} live, over the limit of {self.limit} bytes ({CPU_MEMORY_LIMIT})"
            )

    def resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` was resized in place: a known one changes size, an unknown one grown from 0 is new."""
        if storage.device.type != self.device_type:
            return
        key, nbytes = storage._cdata, int(storage.nbytes())
        grown = nbytes - self.live.get(key, 0)
        if key in self.live:
            self.current += nbytes - self.live[key]
            self.live[key] = nbytes
        elif nbytes > 0:
            self.live[key] = nbytes
            self.current += nbytes
            self._finalizers[key] = weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.current)
        if grown > 0:  # a shrink (FSDP2 freeing an unsharded parameter) never runs out of memory
            self._check(grown)

    def _free(self, key: int) -> None:
        nbytes = self.live.pop(key, None)
        self._finalizers.pop(key, None)
        if nbytes is not None:
            self.current -= nbytes

    def close(self) -> None:
        for fin in self._finalizers.values():
            fin.detach()
        self._finalizers.clear()
        self.live.clear()
        self.current = self.peak = 0


class _LedgerMode(TorchDispatchMode):
    def __init__(self, ledger: _Ledger) -> None:
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        flat, _ = tree_flatten(out)
        # An output aliasing an input (views, in-place and out= ops) is not new memory.
        if not any(r.alias_info is not None for r in returns):
            for value in flat:
                if isinstance(value, torch.Tensor):
                    self.ledger.add(value)
        return out


class _ResizeWatch:
    """Reports in-place storage resizes (FSDP2's ``resize_``, which reaches no dispatch mode) to the
    started ledgers; one wrapper serves every started meter.
    """

    ledgers: ClassVar[list[_Ledger]] = []
    original: ClassVar[Any] = None

    @classmethod
    def add(cls, ledger: _Ledger) -> None:
        if not cls.ledgers:
            cls.original = original = torch.UntypedStorage.resize_

            def resize_(storage: torch.UntypedStorage, size: int) -> Any:
                out = original(storage, size)
                for each in cls.ledgers:
                    each.resized(storage)
                return out

            setattr(torch.UntypedStorage, "resize_", resize_)  # noqa: B010 - restored in remove()
        cls.ledgers.append(ledger)

    @classmethod
    def remove(cls, ledger: _Ledger) -> None:
        if ledger in cls.ledgers:
            cls.ledgers.remove(ledger)
            if not cls.ledgers:
                setattr(torch.UntypedStorage, "resize_", cls.original)  # noqa: B010
                cls.original = None


class StorageMeter(MemoryMeter):
    """Exact accounting of live tensor storage bytes on a device without allocator statistics.

    Costs a Python call per op: use it to measure, not in every step of a long run.
    """

    def __init__(self, device: torch.device | str = "cpu", *, limit: int | None = None) -> None:
        """``limit``: live bytes an allocation may not exceed; on the CPU `cpu_memory_limit` by default."""
        self.device = torch.device(device)
        if limit is None and self.device.type == "cpu":
            limit = cpu_memory_limit()
        self._ledger = _Ledger(self.device.type, limit)
        self._mode: _LedgerMode | None = None

    def start(self) -> None:
        if self._mode is not None:
            raise RuntimeError("StorageMeter is already started")
        self._mode = _LedgerMode(self._ledger)
        self._mode.__enter__()
        _ResizeWatch.add(self._ledger)

    def stop(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            _ResizeWatch.remove(self._ledger)
            mode.__exit__(None, None, None)

    def close(self) -> None:
        """Stop, and forget every storage still on the ledger."""
        self.stop()
        self._ledger.close()

    def reset_peak(self) -> None:
        self._ledger.peak = self._ledger.current

    def track(self, *objs: Any) -> None:
        for obj in objs:
            for t in _tensors_of(obj):
                self._ledger.add(t, allocated=False)

    @property
    def current_bytes(self) -> int:
        return self._ledger.current

    @property
    def peak_bytes(self) -> int:
        return self._ledger.peak


def _tensors_of(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, nn.Module):
        for p in obj.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    else:
        flat, _ = tree_flatten(obj)
        yield from (v for v in flat if isinstance(v, torch.Tensor))


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
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class StepTimer:
    """Duration of one step, device work included.

    Wall-clock on CPU; on CUDA the device time between two events (kernels run asynchronously). See docs/GPU.md.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._start: float | None = None
        self._events: tuple[Any, Any] | None = None
        self.last_seconds: float | None = None

    def start(self) -> None:
        synchronize(self.device)
        if self.device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            self._events = (begin, end)
        self._start = perf_counter()

    def stop(self) -> float | None:
        """Seconds since `start`, or ``None`` if it was not started."""
        if self._start is None:
            return None
        if self._events is not None:
            begin, end = self._events
            end.record()
            end.synchronize()
            self.last_seconds = begin.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds
            self._events = None
        else:
            synchronize(self.device)
            self.last_seconds = perf_counter() - self._start
        self._start = None
        return self.last_seconds
