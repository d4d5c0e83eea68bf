"""Op-level selective recomputation: which ops' outputs ``selective`` keeps.

Built on `torch.utils.checkpoint.create_selective_checkpoint_contexts` (PyTorch's SAC): inside a
checkpointed layer, the outputs of the listed ops are cached in forward and reused in backward;
every other op is recomputed. The default list keeps the GEMMs against weights and the fused
attention kernels (expensive per byte) and recomputes everything elementwise or quadratic in
sequence length that is cheap per byte: norms, activations, dropout, and in eager attention the
score matmul, softmax and the probability-value product (Korthikanti et al. 2022's
"selective activation recomputation").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_recompute.errors import PolicyError

__all__ = ["DEFAULT_SAVE_OPS", "resolve_save_ops", "selective_context_fn"]

DEFAULT_SAVE_OPS: tuple[str, ...] = (
    "aten.mm",
    "aten.addmm",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._flash_attention_forward",
    "aten._efficient_attention_forward",
)
"""Matmuls against weights and fused attention kernels. ``aten.bmm`` is deliberately absent: in
eager attention it produces the (batch, heads, seq, seq) score and context tensors, which are
the cheapest to recompute per byte kept."""


def _lookup(name: str) -> torch._ops.OpOverloadPacket | torch._ops.OpOverload | None:
    parts = name.strip().split(".")
    if len(parts) not in (2, 3) or parts[0] != "aten":
        return None
    packet = getattr(torch.ops.aten, parts[1], None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return None
    if len(parts) == 3:
        return getattr(packet, parts[2], None)
    return packet


def _dropout_index(op: Any) -> int | None:
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dropout_p":
            return i
    return None


@functools.lru_cache(maxsize=64)
def _resolve(names: tuple[str, ...], optional: frozenset[str]) -> frozenset[Any]:
    ops: set[Any] = set()
    for name in names:
        op = _lookup(name)
        if op is None:
            if name in optional:
                continue  # a kernel this PyTorch build does not have (e.g. cuDNN attention on old releases)
            raise PolicyError(
                f"unknown op {name!r}; expected an ATen op such as aten.mm, aten.addmm, aten.bmm "
                f"or aten._scaled_dot_product_flash_attention (optionally with an overload, aten.mm.default)"
            )
        overloads = [op] if isinstance(op, torch._ops.OpOverload) else [getattr(op, o) for o in op.overloads()]
        for ov in overloads:
            if torch.Tag.nondeterministic_seeded in ov.tags and _dropout_index(ov) is None:
                # Caching a random op would skip its RNG draw during recompute and shift the
                # random stream of every later op: dropout would no longer match bit for bit.
                raise PolicyError(f"op {name!r} draws random numbers and cannot be saved by selective recomputation")
        ops.update(overloads)
    return frozenset(ops)


def resolve_save_ops(names: Sequence[str] | None, *, where: str = "selective.save") -> frozenset[Any]:
    """The `OpOverload` set named by ``names`` (``None``: the defaults); `PolicyError` on unknown names."""
    if names is None:
        return _resolve(DEFAULT_SAVE_OPS, frozenset(DEFAULT_SAVE_OPS))
    try:
        return _resolve(tuple(names), frozenset())
    except PolicyError as err:
        raise PolicyError(f"{where}: {err}") from None


def _draws_random(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    # Fused attention kernels are tagged random because of their dropout; with dropout_p == 0
    # they draw nothing, and caching them is safe.
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    i = _dropout_index(op)
    if i is None:
        return True
    p = kwargs.get("dropout_p", args[i] if len(args) > i else 0.0)
    return float(p) != 0.0


def selective_context_fn(save_ops: frozenset[Any]) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for `torch.utils.checkpoint.checkpoint` that saves ``save_ops`` and recomputes the rest.

    An attention kernel running with dropout is recomputed even when listed: caching it would
    skip its RNG draw in recomputation and change every later dropout mask.
    """

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in save_ops and not _draws_random(op, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy_fn)
