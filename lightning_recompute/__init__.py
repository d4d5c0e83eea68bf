"""Per-layer activation recomputation for PyTorch Lightning: `RecomputeCallback` or `apply_policy`.

Names are imported on first use (PEP 562), so reading policy files loads neither Lightning, MLflow nor torch.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on demand
    from lightning_recompute.apply import AppliedPolicy, applied_policy, apply_policy, remove_policy
    from lightning_recompute.auto import AutoRecompute
    from lightning_recompute.callback import QUIET_TRAINER, RecomputeCallback, StepRecord, step_peak
    from lightning_recompute.errors import (
        BatchSizeError,
        BatchSizeWarning,
        DocumentError,
        IncompatibleModelError,
        LayerDiscoveryError,
        PolicyError,
        RecomputeError,
    )
    from lightning_recompute.grads import GradFreeing, free_gradients
    from lightning_recompute.layers import LayerSpec, find_layers, layer_names
    from lightning_recompute.meter import CudaMemoryMeter, MemoryMeter, StepTimer, StorageMeter, memory_meter
    from lightning_recompute.modes import DEFAULT_SAVE_OPS, Mode
    from lightning_recompute.policy import PolicyLike, RecomputePolicy
    from lightning_recompute.sources import as_policy
    from lightning_recompute.tuned_for import TunedFor

# The module that defines each public name.
_EXPORTS: dict[str, str] = {
    name: module
    for module, names in {
        "auto": "AutoRecompute",
        "apply": "AppliedPolicy applied_policy apply_policy remove_policy",
        "callback": "QUIET_TRAINER RecomputeCallback StepRecord step_peak",
        "errors": "BatchSizeError BatchSizeWarning DocumentError IncompatibleModelError LayerDiscoveryError "
        "PolicyError RecomputeError",
        "grads": "GradFreeing free_gradients",
        "layers": "LayerSpec find_layers layer_names",
        "meter": "CudaMemoryMeter MemoryMeter StepTimer StorageMeter memory_meter",
        "modes": "DEFAULT_SAVE_OPS Mode",
        "policy": "PolicyLike RecomputePolicy",
        "sources": "as_policy",
        "tuned_for": "TunedFor",
    }.items()
    for name in names.split()
}

__all__ = [
    "DEFAULT_SAVE_OPS",
    "QUIET_TRAINER",
    "AppliedPolicy",
    "AutoRecompute",
    "BatchSizeError",
    "BatchSizeWarning",
    "CudaMemoryMeter",
    "DocumentError",
    "GradFreeing",
    "IncompatibleModelError",
    "LayerDiscoveryError",
    "LayerSpec",
    "MemoryMeter",
    "Mode",
    "PolicyError",
    "PolicyLike",
    "RecomputeCallback",
    "RecomputeError",
    "RecomputePolicy",
    "StepRecord",
    "StepTimer",
    "StorageMeter",
    "TunedFor",
    "applied_policy",
    "apply_policy",
    "as_policy",
    "find_layers",
    "free_gradients",
    "layer_names",
    "memory_meter",
    "remove_policy",
    "step_peak",
]

try:
    __version__ = version("lightning-recompute")
except PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0.0.0+unknown"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
