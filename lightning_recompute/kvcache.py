"""Key/value caches in recomputed layers: the replay in backward sees, and leaves, the cache as the forward did.

Hugging Face decoders (and models built like them) append each layer's keys and values to a
cache object during the forward whenever ``use_cache`` is on, which it is by default, in training
too. A recomputed layer runs its forward a second time in backward and would append again: the
replayed attention sees twice the keys (``size of tensor a (128) must match ... (64)``), or the
replay saves different tensors than the forward did (``CheckpointError``).

The mechanism chosen here is snapshot and restore: before a recomputed layer's forward, the
state of the cache objects it was given is recorded (a shallow copy of each object's attributes
and of the lists and dicts they hold; tensors are referenced, not copied); the replay runs on that
recorded state and, when it ends (or checkpoint's early stop cuts it short), the state the cache
had just before the replay is put back. So the replay computes exactly what the forward computed,
and the cache is written once.

Why not Hugging Face's own answer (``GradientCheckpointingLayer`` turns ``use_cache`` off and drops
the cache for checkpointed layers in training): a layer that writes no cache runs a different
computation. In GPT-2 the keys returned by the cache are a contiguous concatenation, the keys of a
cache-less call a strided view, and attention over them rounds differently, so turning the cache
off changes the gradients (measured: every GPT-2 weight differs after two AdamW steps). Snapshot
and restore keeps gradients bitwise equal to no recomputation with the model's defaults, keeps the
cache complete (a training-mode ``generate`` with grad still works), and costs no memory beyond
references to tensors the cache held anyway.

Limits: the cache is found by argument name (`CACHE_ARGUMENTS`), and its state must live in
object attributes, lists and dicts, as in transformers' dynamic and encoder-decoder caches (the
defaults). A cache that writes into preallocated tensors in place (``StaticCache``) is a
generation-time structure; training through one is not supported. Without grad (validation,
``generate``, inference) nothing is recomputed and nothing here runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["CACHE_ARGUMENTS", "CacheArguments", "CacheState", "replay_with_cache_state"]

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


def replay_with_cache_state(fn: Callable[..., Any], caches: list[Any]) -> Callable[..., Any]:
    """``fn`` for `torch.utils.checkpoint.checkpoint`: its first call is the forward, any later call a replay
    that runs on the caches' state from before the forward and leaves them as it found them."""
    before = CacheState(caches)
    calls = 0

    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(*args, **kwargs)
        now = CacheState(caches)
        before.restore()
        try:
            return fn(*args, **kwargs)
        finally:
            # Also when checkpoint's early stop interrupts the replay once it has what backward needs.
            now.restore()

    return run
