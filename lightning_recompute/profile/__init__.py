"""Per-layer cost profile of one training step: memory, time and FLOPs per recompute mode.

The step is cut into segments at the layers' boundaries (module hooks in forward, tensor hooks on each layer's
output and input in backward), each a `SegmentCost`; layer segments once per mode, the rest once::

    fixed (embeddings ...) | fwd:0 | ... | fwd:L-1 | fixed (head, loss, zero_grad) | bwd:L-1 | ... | bwd:0 | fixed

The planner relies on: Lightning's automatic optimisation (``zero_grad`` a segment of its own, after the loss),
the second step profiled (optimizer state in the base), every layer run once per step in order, a layer's ``net``
the same in every mode. Time is the median of ``repeats`` interleaved steps (alike layers pool samples), or on
the meta device estimated from FLOPs; ``offload`` costs what ``none`` does on CPU and is emulated on meta.
"""

from __future__ import annotations

from lightning_recompute.profile.measure import profile_model
from lightning_recompute.profile.meta import HARDWARE, Hardware, profile_meta
from lightning_recompute.profile.model import ALL_MODES, LayerProfile, Profile, ProfileError, SegmentCost

__all__ = [
    "ALL_MODES",
    "HARDWARE",
    "Hardware",
    "LayerProfile",
    "Profile",
    "ProfileError",
    "SegmentCost",
    "profile_meta",
    "profile_model",
]
