"""Measurements in a fresh subprocess: trials, numerics checks, device queries and profiles.

One child protocol serves them all: the parent (`tuner.trials.runner`) writes a JSON spec, runs
``python -m tuner.trials.worker SPEC.json RESULT.json`` in its own process group with a deadline,
and reads one JSON result that the child (`tuner.trials.worker`) writes atomically. Whatever the
model does (run out of memory, crash, hang) ends that process only.
"""

from __future__ import annotations

from tuner.trials.runner import (
    NumericsResult,
    Outcome,
    TrialResult,
    check_numerics,
    device_info,
    profile_recipe,
    run_trial,
    summarize_steps,
)

__all__ = [
    "NumericsResult",
    "Outcome",
    "TrialResult",
    "check_numerics",
    "device_info",
    "profile_recipe",
    "run_trial",
    "summarize_steps",
]
