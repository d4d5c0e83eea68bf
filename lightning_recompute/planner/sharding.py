"""Per-rank memory of a ``ddp``, ``fsdp`` or ``model_parallel`` (FSDP2) step: `shard_profile` turns one device's
profile into a rank's; what is modelled: docs/SHARDING.md, 'What the planner assumes'."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from lightning_recompute.planner.solver import PlannerError
from lightning_recompute.profile.model import LayerProfile, Profile, SegmentCost
from lightning_recompute.units import format_bytes

# Strategies the planner predicts per rank (Lightning's names; ``model_parallel`` = FSDP2 without TP).
STRATEGIES: tuple[str, ...] = ("ddp", "fsdp", "model_parallel")

# Lightning strategy classes a recipe's ``class_path`` may name, and the strategy they are planned as.
_CLASS_STRATEGIES = {"DDPStrategy": "ddp", "FSDPStrategy": "fsdp", "ModelParallelStrategy": "model_parallel"}


@dataclass(frozen=True)
class ParamGroup:
    """The parameters of one ``fully_shard`` unit: their shapes and element sizes."""

    name: str  # the layer's module path, or "" for the root (the parameters outside every layer)
    shapes: tuple[tuple[int, ...], ...]
    itemsizes: tuple[int, ...]
    trainable: tuple[bool, ...]

    def shard_bytes(self, world_size: int, trainable_only: bool = False) -> int:
        """Bytes of rank 0's shards (with ``trainable_only``: their gradients): each parameter chunked on dim 0,
        padded to ``ceil(d0 / W)`` rows; world size 1: the parameters whole."""
        return sum(
            -(-(shape[0] if shape else 1) // world_size) * math.prod(shape[1:]) * size
            for shape, size, trainable in zip(self.shapes, self.itemsizes, self.trainable, strict=True)
            if trainable or not trainable_only
        )

    def gathered_bytes(self, world_size: int) -> int:
        """Bytes of the unit's all-gather output, unsharded parameters or reduce-scatter input (padded)."""
        return self.shard_bytes(world_size) * world_size


@dataclass(frozen=True)
class ParamLayout:
    """Which parameters each ``fully_shard`` unit holds: one unit per layer, and the root."""

    layers: tuple[ParamGroup, ...]
    root: ParamGroup

    @classmethod
    def of_model(cls, model: nn.Module, layer_names: Sequence[str]) -> ParamLayout:
        """The layout of ``model`` (any device, meta included) with the layers at ``layer_names``."""
        modules = dict(model.named_modules())
        missing = [n for n in layer_names if n not in modules]
        if missing:
            raise PlannerError(f"layers: {missing} are not modules of {type(model).__name__}")
        owned: set[int] = set()

        def group(name: str, params: Iterable[nn.Parameter]) -> ParamGroup:
            mine = [p for p in params if id(p) not in owned]
            owned.update(map(id, mine))
            shapes = tuple(tuple(p.shape) for p in mine)
            return ParamGroup(name, shapes, tuple(p.element_size() for p in mine), tuple(p.requires_grad for p in mine))

        layers = tuple(group(name, modules[name].parameters()) for name in layer_names)
        return cls(layers, group("", model.parameters()))


@dataclass(frozen=True)
class Sharding:
    """A data-parallel strategy at a world size: what the planner predicts one rank of."""

    strategy: str
    world_size: int

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise PlannerError(f"world size: must be a positive integer, got {self.world_size!r}")
        if self.strategy not in STRATEGIES:
            raise PlannerError(f"strategy: unknown {self.strategy!r}; valid: {', '.join(STRATEGIES)}")

    def describe(self) -> str:
        return f"per rank, world size {self.world_size}, {self.strategy}"


def sharding_for(recipe: Any, world_size: int | None = None, strategy: str | None = None) -> Sharding | None:
    """The sharding to plan ``recipe`` for (its ``trainer`` devices, nodes and strategy, overridden by
    ``world_size`` / ``strategy``); ``None`` for one device. `PlannerError`: what cannot be planned."""
    trainer = recipe.trainer
    devices = getattr(trainer, "devices", 1)
    nodes = getattr(trainer, "num_nodes", 1)
    declared: Any = getattr(trainer, "strategy", "auto")
    if world_size is not None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise PlannerError(f"--world-size: must be a positive integer, got {world_size!r}")
        if isinstance(devices, int) and devices > 1 and world_size % devices:
            raise PlannerError(
                f"--world-size: {world_size} is not a multiple of the recipe's trainer.devices {devices} "
                f"(devices per node); valid: {devices}, {2 * devices}, {4 * devices}, ..."
            )
    else:
        world_size = (devices if isinstance(devices, int) else 1) * (nodes if isinstance(nodes, int) else 1)
    name = strategy if strategy is not None else str(declared)
    path = getattr(declared, "class_path", None)
    if strategy is None and path is not None:  # a class_path with init_args
        cls = str(path).rsplit(".", 1)[-1]
        if cls not in _CLASS_STRATEGIES:
            raise PlannerError(
                f"trainer.strategy: the planner cannot predict {path}; it predicts "
                f"{', '.join(_CLASS_STRATEGIES)} (pass --strategy to plan as one of {', '.join(STRATEGIES)})"
            )
        tp = declared.init_args.get("tensor_parallel_size", 1)
        if cls == "ModelParallelStrategy" and tp not in (1, "auto"):
            raise PlannerError(
                f"trainer.strategy: tensor_parallel_size {tp!r} is not modelled; the planner predicts data "
                f"parallelism only (tensor_parallel_size: 1)"
            )
        name = _CLASS_STRATEGIES[cls]
    if name == "auto":
        name = "ddp"  # what Lightning picks for more than one device
    if name not in STRATEGIES:
        where = "--strategy" if strategy is not None else "trainer.strategy"
        raise PlannerError(f"{where}: the planner cannot predict {name!r}; valid: {', '.join(STRATEGIES)}")
    if world_size == 1 and strategy is None:
        return None
    return Sharding(name, world_size)


def shard_profile(profile: Profile, layout: ParamLayout, sharding: Sharding) -> Profile:
    """The profile one rank of ``sharding`` sees; world size 1: ``profile``."""
    if [g.name for g in layout.layers] != profile.layer_names:
        raise PlannerError(
            f"layout: its layers {[g.name for g in layout.layers][:4]}... differ from the profile's "
            f"{profile.layer_names[:4]}...; build both from the same model and layers"
        )
    if sharding.world_size == 1:
        return profile
    if sharding.strategy == "ddp":
        buckets = sum(g.shard_bytes(1, trainable_only=True) for g in (*layout.layers, layout.root))
        changes: dict[str, Any] = {"base_bytes": profile.base_bytes + buckets}
        note = (
            f"one device's parameters, gradients and optimizer state, plus {format_bytes(buckets)} of DDP "
            "gradient buckets"
        )
    else:
        changes, note = _fsdp(profile, layout, sharding.world_size)
    where = sharding.describe()
    return replace(profile, **changes, device=f"{profile.device}, {where}", notes=[*profile.notes, f"{where}: {note}"])


def _adjust(c: SegmentCost, delta: int, peak: int, grad: int | None = None) -> SegmentCost:
    """``c`` with a new delta, peak (and gradient bytes); the differences are static (not batch-scaled)."""
    g = c.grad if grad is None else grad
    return replace(
        c,
        delta=delta,
        peak=max(peak, 0),
        grad=g,
        static_delta=c.static_delta + (delta - g) - (c.delta - c.grad),
        static_peak=c.static_peak + (max(peak, 0) - max(0, g)) - (c.peak - max(0, c.grad)),
    )


def _fsdp(profile: Profile, layout: ParamLayout, w: int) -> tuple[dict[str, Any], str]:
    """What rank 0 of FSDP2 sees differently (sharded state in the base, the collectives placed), and a note."""
    n, order = len(profile.layers), profile.timeline
    gathered = [g.gathered_bytes(w) for g in layout.layers]  # AG_i = U_i = RS_i
    root_gathered = layout.root.gathered_bytes(w)
    shard_grads = [g.shard_bytes(w, trainable_only=True) for g in layout.layers]
    root_shard_grads = layout.root.shard_bytes(w, trainable_only=True)
    shard_grads_all = sum(shard_grads) + root_shard_grads
    shard_params = sum(g.shard_bytes(w) for g in (*layout.layers, layout.root))
    full_grads = profile.grad_bytes
    ratio = shard_params / profile.param_bytes if profile.param_bytes else 0.0
    shard_optimizer = round(profile.optimizer_bytes * ratio)
    freed = -sum(min(0, c.grad) for c in profile.fixed.values())  # gradients alive when the step starts
    unsharded = profile.base_bytes - profile.param_bytes - profile.optimizer_bytes - freed
    base = unsharded + shard_params + shard_optimizer + round(freed * shard_grads_all / full_grads if full_grads else 0)

    # Each layer: its all-gather buffer, the neighbours' prefetch and reduce-scatter input.
    layers: list[LayerProfile] = []
    for i, lp in enumerate(profile.layers):
        g = gathered[i]
        prev = gathered[i - 1] if i > 0 else root_gathered  # the buffer freed at this unit's forward copy-out
        prefetched = prev if i > 0 else 0  # backward prefetch of unit i-1 (none before unit 0)
        held = gathered[i + 1] if i + 1 < n else 0  # reduce-scatter input of unit i+1, until i's post-backward
        fwd = {m: _adjust(c, c.delta + g - prev, max(g, g - prev + g + c.peak)) for m, c in lp.fwd.items()}
        bwd = {}
        for m, c in lp.bwd.items():
            swap = -g + prefetched  # this unit's buffer freed at its copy-out, unit i-1's prefetched
            peak = max(
                g,  # the copy-out, its buffer still held
                g + swap + c.peak,  # the backward, unsharded parameters and gradients
                c.delta + swap - held + g,  # the post-backward's reduce-scatter input
            )
            delta = c.delta + swap - held + g - c.grad + shard_grads[i]
            bwd[m] = _adjust(c, delta, peak, grad=shard_grads[i])
        net = fwd["none"].delta + bwd["none"].delta if "none" in fwd else lp.net
        layers.append(replace(lp, fwd=fwd, bwd=bwd, net=net, param_bytes=layout.layers[i].shard_bytes(w)))

    # The fixed segments: the root's gathers, prefetch and reduce-scatter placed.
    def fixed_between(a: int, b: int) -> list[str]:
        return [k[len("fixed:") :] for k in order[a:b] if k.startswith("fixed:")]

    before = fixed_between(0, order.index("fwd:0"))
    after_fwd = fixed_between(order.index(f"fwd:{n - 1}") + 1, order.index(f"bwd:{n - 1}"))
    after_bwd = fixed_between(order.index("bwd:0") + 1, len(order))
    if not (before and after_fwd and after_bwd):
        raise PlannerError(
            "profile: FSDP needs fixed segments before the first layer, between forward and backward, and "
            f"after the backward (the root's own work); this timeline has none of some: {order[:3]}..."
        )
    fixed = dict(profile.fixed)
    # Gradients freed before the backward (zero_grad): the sharded gradients, not one device's.
    for key, c in fixed.items():
        if c.grad < 0 and c.scales:
            kept_positive = c.grad + full_grads  # a segment may also allocate the head's gradients
            grad = (
                kept_positive - shard_grads_all if kept_positive >= 0 else round(c.grad * shard_grads_all / full_grads)
            )
            pure_free = c.delta == c.grad and c.peak == 0
            fixed[key] = _adjust(c, c.delta - c.grad + grad, 0 if pure_free else c.peak + grad - c.grad, grad)
    # The root's pre-forward gathers its parameters (kept) and its buffer (freed at unit 0's copy-out).
    c = fixed[before[-1]]
    fixed[before[-1]] = _adjust(c, c.delta + 2 * root_gathered, c.peak + 2 * root_gathered)
    # The root's post-forward frees the last unit's buffer (at ``output`` when the profile marks it).
    key = next((k for k in after_fwd if k.endswith("->output")), after_fwd[0])
    c = fixed[key]
    fixed[key] = _adjust(c, c.delta - gathered[-1], c.peak)
    # The root's pre-backward prefetches the last unit's parameters.
    c = fixed[after_fwd[-1]]
    fixed[after_fwd[-1]] = _adjust(c, c.delta + gathered[-1], c.peak + gathered[-1])
    # The root's post-backward: resharded, unit 0's reduce-scatter input released, its own allocated.
    c = fixed[after_bwd[0]]
    root_grads = full_grads - sum(lp.bwd["none"].grad for lp in profile.layers if "none" in lp.bwd)
    fixed[after_bwd[0]] = _adjust(
        c,
        c.delta - root_gathered - gathered[0] - root_grads + root_shard_grads,
        max(c.peak, c.delta - gathered[0]),
        grad=c.grad - root_grads + root_shard_grads,
    )
    # The optimizer steps over shards: its temporaries shrink with them.
    for key, c in fixed.items():
        if not c.scales:
            fixed[key] = _adjust(c, round(c.delta * ratio), round(c.peak * ratio), round(c.grad * ratio))
    note = (
        f"parameters {format_bytes(shard_params)}, gradients {format_bytes(shard_grads_all)} and optimizer state "
        f"{format_bytes(shard_optimizer)} sharded (rank 0, padded); a layer's gathered parameters up to "
        f"{format_bytes(max(gathered))}, the root's {format_bytes(root_gathered)}; time compute-only"
    )
    sharded = {"param_bytes": shard_params, "grad_bytes": shard_grads_all, "optimizer_bytes": shard_optimizer}
    return {"layers": layers, "fixed": fixed, "base_bytes": base, **sharded}, note
