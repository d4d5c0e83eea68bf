"""Per-layer cost profile of one training step: memory, time and FLOPs per recompute mode.

The step is cut into segments at the layers' boundaries (forward ones from module hooks, backward ones from
tensor hooks on each layer's output and input)::

    fixed (embeddings ...) | fwd:0 | ... | fwd:L-1 | fixed (head, loss, zero_grad) | bwd:L-1 | ... | bwd:0 | fixed

Each segment records its level change (``delta``), its transient above its start (``peak``), the parameter
gradient bytes it allocated (``grad``), its FLOPs and its time; layer segments once per mode (every layer in
that mode), the rest once. The planner composes them into any mixed policy's peak and step time.

Conventions the planner relies on: the step is Lightning's automatic optimisation (``zero_grad`` its own
segment, after the loss), the second step is profiled (optimizer state in the base), every layer runs once per
step in order; a layer's ``net`` does not depend on its mode; time is the median of ``repeats`` interleaved
steps (layers alike share samples), or estimated from FLOPs on the meta device (``time_source``); ``offload``
on CPU is ``none``'s costs, and on meta it is emulated.
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
