"""Which ops' outputs ``selective`` keeps (`create_selective_checkpoint_contexts`); a weight matmul entry may be
qualified by shape (``aten.mm:wide``), as op names cannot tell GEMMs apart (docs/PLUGIN.md, 'Save-list families').
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_recompute.errors import PolicyError
from lightning_recompute.modes import ATTENTION_KERNELS, DEFAULT_SAVE_OPS, SAVE_FAMILIES

MATMUL_ROLES: tuple[str, ...] = ("wide", "narrow")
"""Shape qualifiers of a weight matmul entry: ``wide`` when the output has more features than the input."""

_QUALIFIABLE = ("mm", "addmm")


def _lookup(name: str) -> list[torch._ops.OpOverload] | None:
    """The overloads ``aten.<op>`` or ``aten.<op>.<overload>`` names, or ``None``."""
    parts = name.strip().split(".")
    if len(parts) not in (2, 3) or parts[0] != "aten":
        return None
    packet = getattr(torch.ops.aten, parts[1], None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return None
    if len(parts) == 3:
        op = getattr(packet, parts[2], None)
        return None if op is None else [op]
    return [getattr(packet, o) for o in packet.overloads()]


def _dropout_index(op: Any) -> int | None:
    return next((i for i, arg in enumerate(op._schema.arguments) if arg.name == "dropout_p"), None)


@functools.lru_cache(maxsize=64)
def _resolve(names: tuple[str, ...], optional: frozenset[str]) -> frozenset[Any]:
    ops: set[Any] = set()
    for entry in names:
        name, _, role = entry.partition(":")
        if role and (role not in MATMUL_ROLES or name.strip().split(".")[1:2] not in (["mm"], ["addmm"])):
            raise PolicyError(
                f"save-list entry {entry!r}: a ':' qualifier is only valid on aten.mm or aten.addmm, and is one of "
                f"{', '.join(MATMUL_ROLES)} (e.g. aten.mm:wide)"
            )
        overloads = _lookup(name)
        if overloads is None:
            if name in optional:
                continue  # a kernel this PyTorch build does not have (e.g. cuDNN attention on old releases)
            raise PolicyError(
                f"unknown op {name!r}; expected an ATen op such as aten.mm, aten.addmm, aten.bmm "
                f"or aten._scaled_dot_product_flash_attention (optionally with an overload, aten.mm.default)"
            )
        for ov in overloads:
            if torch.Tag.nondeterministic_seeded in ov.tags and _dropout_index(ov) is None:
                # Caching a random op would skip its RNG draw during recompute and shift every later one.
                raise PolicyError(f"op {name!r} draws random numbers and cannot be saved by selective recomputation")
        ops.update((ov, role) if role else ov for ov in overloads)
    return frozenset(ops)


def resolve_save_ops(names: Sequence[str] | None, *, family: str | None = None) -> frozenset[Any]:
    """The ops named by ``names`` (``None``: the defaults) or ``family``: `OpOverload` (always saved) or
    ``(OpOverload, role)`` (saved for that matmul shape); attention kernels a PyTorch build lacks are skipped."""
    if family is not None:  # a name `RecomputePolicy` checked
        return _resolve(SAVE_FAMILIES[family], frozenset(ATTENTION_KERNELS))
    if names is None:
        return _resolve(DEFAULT_SAVE_OPS, frozenset(DEFAULT_SAVE_OPS))
    try:
        return _resolve(tuple(names), frozenset())
    except PolicyError as err:
        raise PolicyError(f"selective.save: {err}") from None


def selective_context_fn(save_ops: frozenset[Any]) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for `checkpoint` that saves ``save_ops`` and recomputes the rest (an attention kernel
    running with dropout too: caching it would skip its RNG draw)."""
    qualified = any(isinstance(e, tuple) for e in save_ops)

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in save_ops and not _draws_random(op, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        if qualified and (op, _matmul_role(op, args)) in save_ops:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy_fn)


def _draws_random(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    # Fused attention kernels are tagged random for their dropout; with dropout_p == 0 they draw nothing.
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    i = _dropout_index(op)
    return i is None or float(kwargs.get("dropout_p", args[i] if len(args) > i else 0.0)) != 0.0


def _matmul_role(op: Any, args: tuple[Any, ...]) -> str | None:
    """``wide`` or ``narrow`` for ``mm(a, w)`` / ``addmm(bias, a, w)`` by ``w``'s shape (so replays decide alike)."""
    name = op.overloadpacket.__name__ if hasattr(op, "overloadpacket") else ""
    if name not in _QUALIFIABLE:
        return None
    w = args[1] if name == "mm" else args[2]
    return "wide" if w.shape[-1] > w.shape[-2] else "narrow"
