"""Profiling a deep stack of identical layers on meta from cuts of its first 3, 4 and 5 layers (docs/SHARDING.md):
inner layers copy the 4-layer cut's, the rest is affine in depth, checked against the 5-layer cut."""

from __future__ import annotations

import copy
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import fields, replace

from torch import nn

from lightning_recompute.layers import LayerSpec, find_layers
from lightning_recompute.profile.model import LayerProfile, Profile, ProfileError, SegmentCost

MIN_LAYERS = 13  # shorter stacks are stepped in full: the three cuts hold 12 layers between them
_CUTS = (3, 4, 5)
_INDEX = re.compile(r":(\d+)")  # a layer index in a segment key: fwd:3, fixed:bwd_end:3->bwd_start:2


def extrapolated(
    model: nn.Module, layers: LayerSpec, modes: list[str], run: Callable[[LayerSpec, list[str]], Profile]
) -> Profile:
    """``run(layers, modes)``'s profile, from cuts of the stack where it can be, with a note saying which."""
    stack = stack_of(model, layers)
    if stack is None:
        return run(layers, modes)
    why = stack if isinstance(stack, str) else None
    if isinstance(stack, tuple):
        container, names = stack
        try:
            prof = _from_cuts(container, names, modes, run)
            prof.notes.append(
                f"meta: the {len(names)} identical layers {names[0]} .. {names[-1]} were profiled as cuts of 3, 4 "
                f"and 5 layers (inner layers copied, the rest extrapolated and checked; `profile.extrapolate`)"
            )
            return prof
        except ProfileError as err:
            why = str(err)
    prof = run(layers, modes)
    prof.notes.append(f"meta: every layer stepped ({why})")
    return prof


def stack_of(model: nn.Module, layers: LayerSpec) -> tuple[nn.Module, list[str]] | str | None:
    """The container holding exactly the model's layers, and their paths; or why not (``None``: too few)."""
    found = find_layers(model, layers)
    n = len(found)
    if n < MIN_LAYERS:
        return None
    parents = {path.rpartition(".")[0] for path, _ in found}
    if len(parents) != 1:
        return f"the layers sit in {len(parents)} containers, not one"
    parent = parents.pop()
    container = model.get_submodule(parent) if parent else model
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        return (
            f"{parent or type(model).__name__} is a {type(container).__name__}, not an nn.ModuleList or nn.Sequential"
        )
    children = list(container.children())
    if len(children) != n or any(c is not m for c, (_, m) in zip(children, found, strict=True)):
        return f"{parent} holds other modules besides the layers"
    if len({_signature(m) for _, m in found}) != 1:
        return "the layers differ in class or in parameter or buffer shapes"
    layer_types = getattr(getattr(model, "config", None), "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and len(set(layer_types)) > 1:
        return f"config.layer_types mixes {sorted(set(map(str, layer_types)))}"
    return container, [path for path, _ in found]


def _signature(module: nn.Module) -> tuple[object, ...]:
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers())
    return type(module), params, buffers


def _from_cuts(
    container: nn.Module, names: list[str], modes: list[str], run: Callable[[LayerSpec, list[str]], Profile]
) -> Profile:
    """The whole stack's profile from runs of its first 3, 4 and 5 layers; `ProfileError`: why not."""
    cuts, saved = {}, container._modules
    for k in _CUTS:
        container._modules = OrderedDict(list(saved.items())[:k])  # the container with its first k children
        try:
            # Explicit paths for the cut runs: "auto" could pick another, shorter stack there.
            cuts[k] = run(names[:k], modes)
        except Exception as err:  # noqa: BLE001 - e.g. a forward that indexes the stack by its config's depth
            raise ProfileError(
                f"the model does not run with its stack cut to {k} layers ({type(err).__name__}: {err})"
            ) from None
        finally:
            container._modules = saved
    short, long, check = (cuts[k] for k in _CUTS)
    da, db = _assemble(short, long, names[: _CUTS[2]]).to_dict(), check.to_dict()
    for key in da:  # the first field that differs (notes left out; memory runs are untimed)
        if key == "notes" or da[key] == db[key]:
            continue
        a, b, what = da[key], db[key], key
        if key == "layers":
            what = next(f"layer {la['name']}" for la, lb in zip(a, b, strict=True) if la != lb)
        elif key == "fixed":
            what = next(f"segment {k}" for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k))
        raise ProfileError(f"the {_CUTS[2]}-layer run differs from what the 3- and 4-layer runs predict ({what})")
    return _assemble(short, long, names)


def _assemble(short: Profile, long: Profile, names: list[str]) -> Profile:
    """The profile of a stack of ``len(names)`` layers from its 3- and 4-layer cuts; `ProfileError`: why not."""
    n, k3, k4 = len(names), len(short.layers), len(long.layers)
    expanded = _expand(long.timeline, n)

    def affine(q4: int, q3: int) -> int:
        return q4 + (n - k4) * (q4 - q3)

    def affine_cost(c4: SegmentCost, c3: SegmentCost) -> SegmentCost:
        ints = {f.name: affine(getattr(c4, f.name), getattr(c3, f.name)) for f in fields(c4) if f.type == "int"}
        return SegmentCost(**ints, scales=c4.scales)

    def end_layer(c4: LayerProfile, c3: LayerProfile, name: str) -> LayerProfile:
        fwd = {m: affine_cost(c4.fwd[m], c3.fwd[m]) for m in c4.fwd}
        bwd = {m: affine_cost(c4.bwd[m], c3.bwd[m]) for m in c4.bwd}
        return replace(c4, name=name, fwd=fwd, bwd=bwd, net=affine(c4.net, c3.net))

    short_fixed = {_relabel(key, {k3 - 1: n - 1}): c for key, c in short.fixed.items() if not _is_gap(key)}
    sources = {key[len("fixed:") :]: src[len("fixed:") :] for key, src in expanded if key.startswith("fixed:")}
    unmatched = short_fixed.keys() ^ {name for name in sources if not _is_gap(name)}
    if unmatched:
        raise ProfileError(f"the segments {sorted(unmatched)} appear in one of the {k3}- and {k4}-layer runs only")
    fixed = {  # a gap between adjacent layers copied, like the layers; the rest affine
        name: copy.deepcopy(long.fixed[src]) if _is_gap(name) else affine_cost(long.fixed[src], short_fixed[name])
        for name, src in sources.items()
    }
    layers = [end_layer(long.layers[0], short.layers[0], names[0])]
    layers += [replace(copy.deepcopy(long.layers[1]), name=name) for name in names[1:-1]]
    layers.append(end_layer(long.layers[-1], short.layers[-1], names[-1]))
    groups: dict[str, list[str]] = {}
    for layer in layers:
        groups.setdefault(layer.group, []).append(layer.name)
    return replace(
        long,
        layers=layers,
        timeline=[key for key, _ in expanded],
        fixed=fixed,
        groups=groups,
        notes=list(long.notes),
        base_bytes=affine(long.base_bytes, short.base_bytes),
        param_bytes=affine(long.param_bytes, short.param_bytes),
        grad_bytes=affine(long.grad_bytes, short.grad_bytes),
        optimizer_bytes=affine(long.optimizer_bytes, short.optimizer_bytes),
    )


def _relabel(key: str, indices: dict[int, int]) -> str:
    """``key`` with its layer indices mapped by ``indices``."""
    return _INDEX.sub(lambda m: f":{indices.get(int(m[1]), int(m[1]))}", key)


def _indices(key: str) -> set[int]:
    return {int(i) for i in _INDEX.findall(key)}


def _is_gap(key: str) -> bool:
    """Whether a fixed segment's key (``fwd_end:3->fwd_start:4``) lies between two adjacent layers."""
    idx = [int(i) for i in _INDEX.findall(key)]
    return len(idx) == 2 and abs(idx[0] - idx[1]) == 1


def _expand(keys: list[str], n: int) -> list[tuple[str, str]]:
    """The n-layer stack's timeline as ``(key, key of the 4-layer run it copies)``."""
    pos = {k: i for i, k in enumerate(keys)}
    f1, f2, b2, b1 = (pos.get(k, -1) for k in ("fwd:1", "fwd:2", "bwd:2", "bwd:1"))
    if not 0 <= f1 < f2 < b2 < b1:
        raise ProfileError("a segment between layers names a layer out of order")
    out: list[tuple[str, str]] = []
    parts: list[tuple[list[str], set[int], list[dict[int, int]]]] = [
        (keys[:f1], {0, 1}, [{}]),
        (keys[f1:f2], {1, 2}, [{1: i, 2: i + 1} for i in range(1, n - 2)]),
        (keys[f2:b2], {2, 3}, [{2: n - 2, 3: n - 1}]),
        (keys[b2:b1], {1, 2}, [{2: i, 1: i - 1} for i in range(n - 2, 1, -1)]),
        (keys[b1:], {0, 1}, [{}]),
    ]
    for part, allowed, maps in parts:
        if any(not _indices(k) <= allowed for k in part):
            raise ProfileError("a segment between layers names a layer out of order")
        out += [(_relabel(k, indices), k) for indices in maps for k in part]
    return out
