"""Errors raised by the recompute plugin.

One base class so a caller can catch everything the plugin raises about user input; narrow
subclasses so tests and tools can tell the cases apart.
"""

from __future__ import annotations

__all__ = ["IncompatibleModelError", "LayerDiscoveryError", "PolicyError", "RecomputeError"]


class RecomputeError(Exception):
    """Base class of every error raised by lightning_recompute."""


class PolicyError(RecomputeError, ValueError):
    """A recompute policy (file, mapping or object) is invalid or does not fit the model."""


class LayerDiscoveryError(PolicyError):
    """The layers a policy is applied to could not be found in the model."""


class IncompatibleModelError(RecomputeError, RuntimeError):
    """The model is already set up for recomputation by something else (another wrapper or the strategy)."""
