"""Errors raised by the recompute plugin (one base class, narrow subclasses), and how messages show untrusted values."""

from __future__ import annotations

CLIP_CHARS = 200
"""How much of an offending value an error message echoes."""


class RecomputeError(Exception):
    """Base class of every error raised by lightning_recompute."""


class DocumentError(RecomputeError, ValueError):
    """A YAML/JSON file is unreadable, malformed, or over the bounds `lightning_recompute.safe_yaml` reads."""


class PolicyError(RecomputeError, ValueError):
    """A recompute policy (file, mapping or object) is invalid or does not fit the model."""


class LayerDiscoveryError(PolicyError):
    """The layers a policy is applied to could not be found in the model."""


class IncompatibleModelError(RecomputeError, RuntimeError):
    """The model is already set up for recomputation by something else (another wrapper or the strategy)."""


class BatchSizeError(RecomputeError, ValueError):
    """Training runs at a larger micro-batch than the policy was tuned for, and strictness was asked for."""


class BatchSizeWarning(UserWarning):
    """Training runs at a larger micro-batch than the policy was tuned for: it may not fit the budget."""


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """``text`` cut to ``limit`` characters, with a note of its full length when cut (values may be huge)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
