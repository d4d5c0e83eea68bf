"""What a recomputed layer's replay sees and leaves: its buffers and its KV caches, as the forward had them.

A recomputed layer runs its forward a second time in backward (the replay). Whatever that forward
changes besides its output would change twice, and the replay would compute from the changed
state, not from the state the forward saw:

- **Buffers** the forward updates: BatchNorm's running statistics and ``num_batches_tracked``,
  spectral norm's power-iteration vectors (a second iteration gives a different weight), a user's
  counters and EMAs. Before a recomputed layer's forward, every buffer of the layer (its submodules'
  included) is copied (`BufferState`). The replay runs with those copies swapped in as the buffers,
  and the live buffers (whatever objects they are by then: a forward may reassign a buffer) are
  swapped back when it ends, early stop included. So the replay computes what the forward computed,
  and the buffers are updated once, by the forward. What it costs: for a layer without buffers
  (most transformer blocks), nothing; for a layer with buffers, a copy of them held from its forward
  to its replay (a BatchNorm over C channels: two C-element statistics and an 8-byte counter).
  These are ordinary allocations, so the CPU ledger and the profile count them.
- **KV caches.** Hugging Face decoders (and models built like them) append each layer's keys and
  values to a cache object during the forward whenever ``use_cache`` is on, which it is by
  default, in training too. A replay would append again: the replayed attention sees twice the
  keys (``size of tensor a (128) must match ... (64)``), or the replay saves different tensors
  than the forward did (``CheckpointError``). Before the forward, the state of the cache objects the
  layer was given is recorded (a shallow copy of each object's attributes and of the lists and
  dicts they hold; tensors are referenced, not copied, so it costs no memory); the replay runs on
  that state and, when it ends, the state the cache had just before the replay is put back
  (`CacheState`).

  Why not Hugging Face's own answer (``GradientCheckpointingLayer`` turns ``use_cache`` off and
  drops the cache for checkpointed layers in training): a layer that writes no cache runs a
  different computation. In GPT-2 the keys returned by the cache are a contiguous concatenation,
  the keys of a cache-less call a strided view, and attention over them rounds differently, so
  turning the cache off changes the gradients. Snapshot and restore keeps gradients bitwise equal to
  no recomputation with the model's defaults and keeps the cache complete (a training-mode
  ``generate`` with grad still works).

What cannot be put back: Python-level side effects of the forward (an attribute reassigned, a list
appended to, a log line, a global counter) happen again in the replay. The replay notices an
attribute of the layer's modules reassigned while it ran and warns once per layer
(`SideEffectWarning`); docs/PLUGIN.md ("Side effects") gives the pattern to use instead.

Limits: the cache is found by argument name (`CACHE_ARGUMENTS`), and its state must live in object
attributes, lists and dicts, as in transformers' dynamic and encoder-decoder caches (the defaults).
A cache that writes into preallocated tensors in place (``StaticCache``) is a generation-time
structure; training through one is not supported. Without grad (validation, ``generate``,
inference) nothing is recomputed and nothing here runs. Inside a compiled graph the recomputation is
functional (buffer writes are applied once), so nothing here runs there either (`Replay`).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "CACHE_ARGUMENTS",
    "BufferState",
    "CacheArguments",
    "CacheState",
    "Replay",
    "SideEffectWarning",
]

CACHE_ARGUMENTS: tuple[str, ...] = ("cache", "past_key_values", "past_key_value", "layer_past")
"""Names a layer's cache object goes by, across transformers releases and model families."""


@dataclass(frozen=True)
class CacheArguments:
    """Where a layer's forward takes its cache object: by keyword always, by position where its signature says."""

    positions: dict[str, int]
    """Positional index (``self`` excluded) of each cache parameter the signature names positionally."""

    @classmethod
    def of(cls, forward: Callable[..., Any], *, bound: bool) -> CacheArguments:
        """Inspect ``forward`` (a function taking ``self`` first unless ``bound``)."""
        try:
            params = list(inspect.signature(forward).parameters.values())
        except (TypeError, ValueError):  # builtins and some C extensions have no signature
            params = []
        if not bound and params:
            params = params[1:]
        positions = {
            p.name: i
            for i, p in enumerate(params)
            if p.name in CACHE_ARGUMENTS and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        }
        return cls(positions=positions)

    def caches(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """The cache objects in this call's arguments (``None`` values left out)."""
        found = []
        for name in CACHE_ARGUMENTS:
            if name in kwargs:
                value = kwargs[name]
            elif 0 <= self.positions.get(name, -1) < len(args):
                value = args[self.positions[name]]
            else:
                continue
            if value is not None and not isinstance(value, (bool, int, float, str, torch.Tensor)):
                found.append(value)
        return found


class CacheState:
    """A shallow record of a cache object graph: every object's attributes, every list's and dict's items."""

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
            elif isinstance(obj, dict):
                obj.clear()
                obj.update(saved)
            else:
                obj.__dict__.clear()
                obj.__dict__.update(saved)


class SideEffectWarning(UserWarning):
    """A recomputed layer's replay changed Python-level state of its modules: it happened twice."""


class BufferState:
    """A copy of every buffer of a layer (its submodules' included), taken before its forward, for the replay.

    Every buffer, not only the ones the forward changes: whether a forward changed a buffer cannot be
    told cheaply. BatchNorm's kernel writes its running statistics without bumping their version
    counter, and comparing values would synchronize a GPU on every layer of every step.
    """

    def __init__(self, module: nn.Module) -> None:
        self._before = [
            (owner, name, tensor.detach().clone())
            for owner in module.modules()
            for name, tensor in owner._buffers.items()
            if tensor is not None
        ]

    @property
    def nbytes(self) -> int:
        """Bytes held from the forward to the replay."""
        return sum(t.untyped_storage().nbytes() for _, _, t in self._before)

    def swapped_in(self, *, copy: bool) -> list[tuple[nn.Module, str, torch.Tensor | None]]:
        """Put the earlier values in as the buffers; returns the live buffers, for `swap_back`.

        With ``copy``, copies of them, so that a second replay (``retain_graph``) starts from them
        too. Selective recomputation runs no op its forward did not (its replay would fail to match
        the forward's ops), and it allows one backward only: it swaps the earlier values in directly.
        """
        # Every copy first: an out-of-memory error while copying must leave no buffer swapped.
        values = [before.clone() if copy else before for _, _, before in self._before]
        live = [(owner, name, owner._buffers.get(name)) for owner, name, _ in self._before]
        for (owner, name, _), value in zip(self._before, values, strict=True):
            owner._buffers[name] = value
        return live

    @staticmethod
    def swap_back(live: list[tuple[nn.Module, str, torch.Tensor | None]]) -> None:
        for owner, name, tensor in live:
            owner._buffers[name] = tensor


class _Attributes:
    """Which object each attribute of a layer's modules holds, to tell whether a replay reassigned one."""

    def __init__(self, module: nn.Module) -> None:
        self._ids = [
            (path, owner, {k: id(v) for k, v in owner.__dict__.items()}) for path, owner in module.named_modules()
        ]

    def reassigned(self) -> str | None:
        """The first attribute reassigned or added since the record (``"attn.calls"``), or ``None``.

        Tensors are left out: a tensor attribute a forward sets is derived from parameters and buffers
        (``nn.utils.spectral_norm`` and ``weight_norm`` reassign ``weight`` on every call), which the
        replay sees as the forward did."""
        for path, owner, ids in self._ids:
            for key, value in owner.__dict__.items():
                if ids.get(key) != id(value) and not isinstance(value, torch.Tensor):
                    return f"{path}.{key}" if path else key
        return None


class Replay:
    """The function `torch.utils.checkpoint.checkpoint` runs for one call of a recomputed layer.

    Its first call is the forward, any later call a replay that runs on the buffers' and caches' state
    from before the forward and leaves them as it found them. ``selective``: the checkpoint runs
    PyTorch's selective recomputation (see `BufferState.swapped_in`). ``where`` names the layer in a
    `SideEffectWarning`; ``warned`` holds the layers already warned about.

    Under ``torch.compile`` the state is recorded only if the checkpoint ends up running eagerly:
    Dynamo traces this object as the checkpoint's body, where `torch.compiler.is_compiling` is true
    and the compiled graph's recomputation writes nothing; when the body has side effects Dynamo
    cannot trace (a buffer reassigned), it runs the checkpoint eagerly instead, and this object then
    records the state at its first call (``record_now`` false), inside the checkpoint.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        module: nn.Module,
        caches: list[Any],
        *,
        selective: bool,
        where: str,
        warned: set[str],
        record_now: bool = True,
    ) -> None:
        self.fn, self.module, self.caches = fn, module, caches
        self.selective, self.where, self.warned = selective, where, warned
        self.calls = 0
        self.state = self._record() if record_now else None

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
        live: list[tuple[nn.Module, str, torch.Tensor | None]] = []
        attributes = _Attributes(self.module) if self.where not in self.warned else None
        try:
            before.restore()
            live = buffers.swapped_in(copy=not self.selective)
            return self.fn(*args, **kwargs)
        finally:
            # Also when checkpoint's early stop interrupts the replay once it has what backward needs.
            BufferState.swap_back(live)
            now.restore()
            changed = attributes.reassigned() if attributes is not None else None
            if changed is not None:
                self._warn(changed)

    def _warn(self, changed: str) -> None:
        self.warned.add(self.where)
        warnings.warn(
            f"lightning_recompute: layer {self.where!r} is recomputed, and its forward reassigned "
            f"{changed!r} again when replayed in backward: Python-level state a forward changes "
            f"changes twice under recomputation. Keep such state in a buffer (register_buffer, "
            f"updated in place or reassigned), which recomputation restores; see docs/PLUGIN.md, "
            f"'Side effects'.",
            SideEffectWarning,
            stacklevel=3,
        )
