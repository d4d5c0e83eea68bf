"""Measurements in a fresh subprocess: trials, races, numerics checks, device queries and profiles.

The parent (`tuner._trials.runner`) writes a spec (`tuner._trials.protocol`), runs the child
(`tuner._trials.worker`) in its own process group with a deadline, and reads the one result it writes:
whatever the model does ends that process only. The names below load the runner on first use (PEP 562),
so that the child, which imports this package too, spends none of its deadline importing the parent side.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tuner._trials.runner import (
        NumericsResult,
        Outcome,
        TrialResult,
        check_numerics,
        clean_stale_trial_dirs,
        device_info,
        merge_ranks,
        profile_recipe,
        run_race,
        run_trial,
        summarize_steps,
    )

__all__ = [
    "NumericsResult",
    "Outcome",
    "TrialResult",
    "check_numerics",
    "clean_stale_trial_dirs",
    "device_info",
    "merge_ranks",
    "profile_recipe",
    "run_race",
    "run_trial",
    "summarize_steps",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module("tuner._trials.runner"), name)
        globals()[name] = value  # once loaded, a plain attribute (monkeypatch sees and replaces it)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
