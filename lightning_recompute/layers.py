"""Finding a policy's layers by module path: ``"auto"`` takes the longest stack of same-class children and every
other stack, not nested in a chosen one, at least half as long (both stacks of an encoder-decoder)."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

from lightning_recompute.errors import LayerDiscoveryError

LayerSpec = str | type | Sequence[str | type]
"""``"auto"``; or module paths / globs, module classes, or ``"class:Name"`` strings, alone or in a list."""


def find_layers(model: nn.Module, layers: LayerSpec = "auto") -> list[tuple[str, nn.Module]]:
    """The ``(path, module)`` layers of ``model`` in module order; `LayerDiscoveryError` when nothing matched."""
    if isinstance(layers, str) and layers == "auto":
        return _auto(model)
    specs: list[str | type] = [layers] if isinstance(layers, (str, type)) else list(layers)
    if not specs:
        raise LayerDiscoveryError("layers: an empty selection; pass 'auto', module paths, globs or classes")
    found: list[tuple[str, nn.Module]] = []
    hit: set[int] = set()
    for path, module in model.named_modules():
        # Outermost matches only: a sub-block recomputed inside a recomputed block runs three times.
        if not path or any(path.startswith(f"{taken}.") for taken, _ in found):
            continue
        i = next((i for i, spec in enumerate(specs) if _spec_matches(spec, path, module)), None)
        if i is not None:
            hit.add(i)
            found.append((path, module))
    unmatched = [s if isinstance(s, str) else f"class {s.__qualname__}" for i, s in enumerate(specs) if i not in hit]
    if unmatched:
        raise LayerDiscoveryError(
            f"layers: {unmatched} match no module of {type(model).__name__}; "
            f"candidate module paths include: {_candidates(model)}"
        )
    return found


def layer_names(model: nn.Module, layers: LayerSpec = "auto") -> list[str]:
    """The module paths `find_layers` returns."""
    return [p for p, _ in find_layers(model, layers)]


def _auto(model: nn.Module) -> list[tuple[str, nn.Module]]:
    stacks: list[tuple[int, str, list[tuple[str, nn.Module]]]] = []  # (module order, path prefix, layers)
    for order, (path, module) in enumerate(model.named_modules()):
        children = list(module.named_children())
        same_class = len(children) >= 2 and len({type(c) for _, c in children}) == 1
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and same_class:
            prefix = f"{path}." if path else ""
            stacks.append((order, prefix, [(prefix + name, child) for name, child in children]))
    # Longest first; among equals the outermost, so a stack nested in an equally long one is left out.
    stacks.sort(key=lambda s: (-len(s[2]), s[0]))
    chosen: list[tuple[int, str, list[tuple[str, nn.Module]]]] = []
    for stack in stacks:
        if chosen and 2 * len(stack[2]) < len(chosen[0][2]):
            break
        # One stack inside another (or the same): recomputing both would nest checkpoints.
        if not any(stack[1].startswith(other[1]) or other[1].startswith(stack[1]) for other in chosen):
            chosen.append(stack)
    if not chosen:
        raise LayerDiscoveryError(
            f"layers='auto': no repeated blocks found in {type(model).__name__} (looked for an nn.ModuleList "
            f"or nn.Sequential of at least two modules of one class); pass layers= explicitly as module paths, "
            f"globs or classes. Candidate module paths include: {_candidates(model)}"
        )
    return [layer for _, _, layers in sorted(chosen, key=lambda s: s[0]) for layer in layers]  # module order


def _spec_matches(spec: str | type, path: str, module: nn.Module) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    if spec.startswith("class:"):
        cls = type(module)
        return spec[len("class:") :] in (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}")
    return path == spec or fnmatch.fnmatchcase(path, spec)


def _candidates(model: nn.Module, limit: int = 15) -> str:
    paths = [p for p, _ in model.named_modules() if p and p.count(".") <= 1]
    more = f", ... ({len(paths) - limit} more)" if len(paths) > limit else ""
    return ", ".join(paths[:limit]) + more if paths else "(none)"
