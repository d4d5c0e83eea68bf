"""Applying a `RecomputePolicy` to a model's layers as instance-level ``forward``s (not wrapper modules, so module
paths, hooks and ``state_dict`` keys stay as they were), and taking it off again.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_recompute.errors import IncompatibleModelError
from lightning_recompute.layers import LayerSpec, find_layers
from lightning_recompute.policy import Mode, PolicyLike, RecomputePolicy
from lightning_recompute.replay import Replay, cache_positions, caches_in
from lightning_recompute.selective import resolve_save_ops, selective_context_fn
from lightning_recompute.sources import as_policy

_STATE_ATTR = "_lightning_recompute_applied"
_COMPILED_ATTR = "_lightning_recompute_compiled"

COMPILED_RTOL, COMPILED_ATOL = 1e-4, 1e-5
"""How far gradients of compiled layers may be from eager without recompute (``assert_close``'s tolerances)."""


@dataclass(frozen=True)
class AppliedPolicy:
    """What `apply_policy` did: the policy, and the mode it gave each layer."""

    policy: RecomputePolicy
    modes: Mapping[str, Mode]

    @property
    def layers(self) -> list[str]:
        return list(self.modes)

    def describe(self) -> str:
        return self.policy.describe(self.layers)


class _RecomputedForward:
    """The instance ``forward`` of a recomputed layer; an object, not a closure, so the model pickles."""

    def __init__(
        self, module: nn.Module, name: str, mode: Mode, context_fn: Callable[[], Any] | None, warned: set[str]
    ) -> None:
        self.module, self.name, self.mode, self.context_fn = module, name, mode, context_fn
        self.previous = module.__dict__.get("forward")  # an instance forward installed before us, kept to restore
        self.cache_positions = cache_positions(self.previous or type(module).forward, bound=self.previous is not None)
        self.warned = warned  # what `apply_policy`'s layers warned of: a layer's replay, offload on CPU ("")

    def inner(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        if self.mode is Mode.OFFLOAD:
            on_cuda = any(isinstance(v, torch.Tensor) and v.is_cuda for v in (*args, *kwargs.values()))
            if on_cuda or any(p.is_cuda for p in self.module.parameters()):
                with _OffloadActivations(self.module, device_type="cuda", pin_memory=True):
                    return self.inner(*args, **kwargs)
            if "" not in self.warned:
                self.warned.add("")
                warnings.warn(
                    "lightning_recompute: mode 'offload' has no effect on CPU: activations already live in host "
                    "memory, so these layers run exactly as with mode 'none'.",
                    UserWarning,
                    stacklevel=2,
                )
            return self.inner(*args, **kwargs)
        fn = Replay(self, caches_in(self.cache_positions, args, kwargs))
        extra: dict[str, Any] = {} if self.context_fn is None else {"context_fn": self.context_fn}
        # preserve_rng_state replays the forward's RNG state, so dropout masks are identical.
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


class _OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Moves a layer's activations (not its weights, unlike ``save_on_cpu``) to host memory until backward."""

    def __init__(self, module: nn.Module, *, device_type: str, pin_memory: bool) -> None:
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}

        def pack(t: torch.Tensor) -> Any:
            if t.device.type != device_type or t.untyped_storage().data_ptr() in params:
                return t
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin_memory)
            host.copy_(t, non_blocking=pin_memory)
            return (t.device, host)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, tuple):
                device, host = packed
                return host.to(device, non_blocking=pin_memory)
            return packed

        super().__init__(pack, unpack)


def applied_policy(model: nn.Module) -> AppliedPolicy | None:
    """The policy `apply_policy` put on ``model``, or ``None``."""
    return model.__dict__.get(_STATE_ATTR)


def apply_policy(model: nn.Module, policy: PolicyLike, layers: LayerSpec = "auto") -> AppliedPolicy:
    """Apply ``policy`` to the ``layers`` of ``model`` in place, replacing any policy applied before; an
    `IncompatibleModelError` if the model carries activation checkpointing already."""
    policy = as_policy(policy)
    _refuse_foreign_checkpointing(model)
    remove_policy(model)
    found = find_layers(model, layers)
    modes = policy.resolve([name for name, _ in found])
    context_fns: dict[str | None, Callable[[], Any]] = {}  # one per save list in use, shared by its layers
    warned: set[str] = set()
    for name, module in found:
        mode, family = modes[name], policy.family_for(name)
        if mode is Mode.SELECTIVE and family not in context_fns:
            save = resolve_save_ops(policy.selective_save, family=family)
            context_fns[family] = selective_context_fn(save)
        if mode is not Mode.NONE:
            context_fn = context_fns[family] if mode is Mode.SELECTIVE else None
            module.forward = _RecomputedForward(module, name, mode, context_fn, warned)
    if policy.compile:
        # Each layer's call, around its recompute wrapper (torchtitan's order), as nn.Module.compile does.
        for _, module in found:
            if getattr(module, "_compiled_call_impl", None) is None:  # not compiled by the user already
                module._compiled_call_impl = CompiledCall(module)
                module.__dict__[_COMPILED_ATTR] = True
    applied = AppliedPolicy(policy=policy, modes=modes)
    model.__dict__[_STATE_ATTR] = applied
    return applied


def remove_policy(model: nn.Module) -> RecomputePolicy | None:
    """Take off whatever `apply_policy` put on ``model``; returns the policy that was applied, if any."""
    for module in model.modules():
        if module.__dict__.pop(_COMPILED_ATTR, False):
            module._compiled_call_impl = None  # what nn.Module.compile set; the module runs eagerly again
        fwd = module.__dict__.get("forward")
        if isinstance(fwd, _RecomputedForward):
            if fwd.previous is not None:
                module.forward = fwd.previous
            else:
                del module.__dict__["forward"]
    applied = model.__dict__.pop(_STATE_ATTR, None)
    return None if applied is None else applied.policy


class CompiledCall:
    """A layer's compiled call, run eagerly under a dispatch mode (the CPU ledger, ``FlopCounterMode``), under
    which dynamo would run the frame eagerly and never compile it afterwards."""

    def __init__(self, module: nn.Module) -> None:
        self.eager = module._call_impl
        self.compiled = torch.compile(module._call_impl)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch._C._len_torch_dispatch_stack() > 0:
            return self.eager(*args, **kwargs)
        return self.compiled(*args, **kwargs)


def _refuse_foreign_checkpointing(model: nn.Module) -> None:
    """Two recompute mechanisms on one layer recompute it twice (or fight over saved tensors)."""
    # Two imports, two guards: one private path moving in a PyTorch release must not turn off the other check.
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

        wrappers: tuple[type, ...] = (ActivationWrapper,)
    except ImportError:  # PyTorch built without distributed
        wrappers = ()
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:
        _get_registry = None  # type: ignore[assignment]
    for path, module in model.named_modules():
        where = path or type(model).__name__
        if isinstance(module, wrappers):
            raise IncompatibleModelError(
                f"module {where!r} is a {type(module).__name__} (torch checkpoint_wrapper, e.g. from a strategy's "
                f"activation_checkpointing_policy or apply_activation_checkpointing); remove that wrapping or do "
                f"not use lightning_recompute on this model"
            )
        if _get_registry is not None and "checkpoint" in (_get_registry(module) or {}):
            raise IncompatibleModelError(
                f"module {where!r} has torch.distributed._composable.checkpoint applied; remove it or do not use "
                f"lightning_recompute on this model"
            )
        if module.__dict__.get("gradient_checkpointing") is True:
            raise IncompatibleModelError(
                f"module {where!r} has gradient_checkpointing enabled (Hugging Face style); call "
                f"model.gradient_checkpointing_disable() and let the policy decide per layer"
            )
