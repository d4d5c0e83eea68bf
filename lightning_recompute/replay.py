"""What a recomputed layer's replay in backward sees and leaves: its buffers and KV caches as the forward had
them, so both change once and gradients stay bitwise equal (docs/PLUGIN.md, 'Models' and 'Side effects').
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

CACHE_ARGUMENTS: tuple[str, ...] = ("cache", "past_key_values", "past_key_value", "layer_past")
"""Names a layer's cache object goes by, across transformers releases and model families."""


def cache_positions(forward: Callable[..., Any], *, bound: bool) -> dict[str, int]:
    """Where ``forward`` (taking ``self`` first unless ``bound``) takes a cache object by position, if it can."""
    try:
        params = list(inspect.signature(forward).parameters.values())[0 if bound else 1 :]
    except (TypeError, ValueError):  # builtins and some C extensions have no signature
        params = []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {p.name: i for i, p in enumerate(params) if p.name in CACHE_ARGUMENTS and p.kind in kinds}


def caches_in(positions: dict[str, int], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The cache objects in a call's arguments, by keyword or at ``positions`` (``None`` and plain values left out)."""
    found = []
    for name in CACHE_ARGUMENTS:
        position = positions.get(name, len(args))
        value = kwargs[name] if name in kwargs else args[position] if position < len(args) else None
        if value is not None and not isinstance(value, (bool, int, float, str, torch.Tensor)):
            found.append(value)
    return found


class CacheState:
    """A shallow record of a cache object graph (tensors referenced, not copied)."""

    def __init__(self, roots: list[Any]) -> None:
        self._saved: list[tuple[Any, Any]] = []
        seen: set[int] = set()
        for root in roots:
            self._record(root, seen)

    def _record(self, obj: Any, seen: set[int]) -> None:
        if id(obj) in seen or isinstance(obj, (torch.Tensor, nn.Module, type, str, bytes, int, float, bool)):
            return
        seen.add(id(obj))
        if isinstance(obj, list):
            self._saved.append((obj, list(obj)))
            children: Any = obj
        elif isinstance(obj, dict):
            self._saved.append((obj, dict(obj)))
            children = obj.values()
        elif hasattr(obj, "__dict__") and not callable(obj):
            self._saved.append((obj, dict(obj.__dict__)))
            children = obj.__dict__.values()
        else:
            return
        for child in list(children):
            self._record(child, seen)

    def restore(self) -> None:
        """Put every recorded object back as it was recorded (the same objects, mutated in place)."""
        for obj, saved in self._saved:
            if isinstance(obj, list):
                obj[:] = saved
            else:
                target = obj if isinstance(obj, dict) else obj.__dict__
                target.clear()
                target.update(saved)


class SideEffectWarning(UserWarning):
    """A recomputed layer's replay changed Python-level state of its modules: it happened twice."""


class BufferState:
    """A copy of every buffer of a layer taken before its forward for the replay: every one, since BatchNorm writes
    its statistics without bumping their version, and comparing would sync a GPU."""

    def __init__(self, module: nn.Module) -> None:
        self._before = [
            (owner, name, tensor.detach().clone())
            for owner in module.modules()
            for name, tensor in owner._buffers.items()
            if tensor is not None
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for _, _, t in self._before)

    @contextlib.contextmanager
    def swapped_in(self, *, copy: bool) -> Iterator[None]:
        """The earlier values as the buffers (with ``copy``, copies, so a second replay under ``retain_graph``
        starts from them too; selective recomputation allows one backward only), the live ones put back after."""
        # Every copy first: an out-of-memory error must leave no buffer swapped.
        values = [before.clone() if copy else before for _, _, before in self._before]
        live = [(owner, name, owner._buffers.get(name)) for owner, name, _ in self._before]
        try:
            for (owner, name, _), value in zip(self._before, values, strict=True):
                owner._buffers[name] = value
            yield
        finally:
            for owner, name, tensor in live:
                owner._buffers[name] = tensor


def _attribute_ids(module: nn.Module) -> list[tuple[str, nn.Module, dict[str, int]]]:
    """Which object each attribute of a layer's modules holds, to tell whether a replay reassigned one."""
    return [(path, owner, {k: id(v) for k, v in owner.__dict__.items()}) for path, owner in module.named_modules()]


def _reassigned(ids: list[tuple[str, nn.Module, dict[str, int]]]) -> str | None:
    """The first attribute reassigned or added since `_attribute_ids` (``"attn.calls"``), or ``None``; tensors are
    left out, being derived from parameters and buffers (``spectral_norm`` reassigns ``weight`` every call)."""
    for path, owner, before in ids:
        for key, value in owner.__dict__.items():
            if before.get(key) != id(value) and not isinstance(value, torch.Tensor):
                return f"{path}.{key}" if path else key
    return None


class Replay:
    """What `checkpoint` runs for one call of a recomputed layer (``forward``, an `apply._RecomputedForward`):
    first the forward, then replays on the state from before it."""

    def __init__(self, forward: Any, caches: list[Any]) -> None:
        self.fn, self.module, self.caches = forward.inner, forward.module, caches
        self.selective, self.where, self.warned = forward.context_fn is not None, forward.name, forward.warned
        self.calls = 0
        # Under torch.compile, recorded at the first call if the checkpoint runs eagerly: the compiled graph's
        # recomputation writes nothing.
        self.state = None if torch.compiler.is_compiling() else self._record()

    def _record(self) -> tuple[BufferState, CacheState]:
        return BufferState(self.module), CacheState(self.caches)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return self.fn(*args, **kwargs)
        self.calls += 1
        if self.state is None:
            self.state = self._record()
        if self.calls == 1:
            return self.fn(*args, **kwargs)
        buffers, before = self.state
        now = CacheState(self.caches)
        ids = _attribute_ids(self.module) if self.where not in self.warned else None
        try:
            before.restore()
            with buffers.swapped_in(copy=not self.selective):
                return self.fn(*args, **kwargs)
        finally:
            now.restore()  # also when checkpoint's early stop interrupts the replay
            changed = _reassigned(ids) if ids is not None else None
            if changed is not None:
                self.warned.add(self.where)
                warnings.warn(
                    f"lightning_recompute: layer {self.where!r} is recomputed, and its forward reassigned "
                    f"{changed!r} again when replayed in backward: Python-level state a forward changes "
                    f"changes twice under recomputation. Keep such state in a buffer (register_buffer, "
                    f"updated in place or reassigned), which recomputation restores; see docs/PLUGIN.md, "
                    f"'Side effects'.",
                    SideEffectWarning,
                    stacklevel=2,
                )
