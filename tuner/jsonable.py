"""The one conversion of the tuner's objects to JSON-ready plain types (summaries, artifacts, specs)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from datetime import datetime
from typing import Any

from lightning_recompute.policy import RecomputePolicy

__all__ = ["jsonable"]


def jsonable(value: Any) -> Any:
    """A JSON-ready copy of results, policies, paths, dataclasses and mappings (non-finite floats become null)."""
    if isinstance(value, RecomputePolicy):
        return value.to_dict()
    if hasattr(value, "to_dict") and callable(value.to_dict):
        return jsonable(value.to_dict())
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)
