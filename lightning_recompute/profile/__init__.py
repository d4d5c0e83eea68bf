"""Per-layer, per-mode cost of one training step, cut into segments at the layers' boundaries (`SegmentCost`);
measured (`profile_model`) or computed on the meta device (`profile_meta`)."""

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
