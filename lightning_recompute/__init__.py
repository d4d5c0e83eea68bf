"""Per-layer activation recomputation for PyTorch Lightning.

Add `RecomputeCallback` to a ``Trainer`` (or call `apply_policy` in ``configure_model``) to
choose, per layer, which activations are kept, recomputed or offloaded.
"""

from __future__ import annotations

from lightning_recompute.apply import AppliedPolicy, applied_policy, apply_policy, remove_policy
from lightning_recompute.callback import RecomputeCallback, StepRecord
from lightning_recompute.errors import IncompatibleModelError, LayerDiscoveryError, PolicyError, RecomputeError
from lightning_recompute.layers import LayerSpec, find_layers, layer_names
from lightning_recompute.meter import CudaMemoryMeter, MemoryMeter, StepTimer, StorageMeter, memory_meter
from lightning_recompute.policy import Mode, PolicyLike, RecomputePolicy
from lightning_recompute.selective import DEFAULT_SAVE_OPS

__all__ = [
    "DEFAULT_SAVE_OPS",
    "AppliedPolicy",
    "CudaMemoryMeter",
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
    "applied_policy",
    "apply_policy",
    "find_layers",
    "layer_names",
    "memory_meter",
    "remove_policy",
]

__version__ = "0.1.0"
