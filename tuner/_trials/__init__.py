"""Measurements in a fresh subprocess: trials, numerics checks, device queries and profiles.

One child protocol serves them all: the parent (`tuner._trials.runner`) writes a JSON spec (one of
`tuner._trials.protocol`'s typed, versioned kinds), runs
``python -m tuner._trials.worker SPEC.json RESULT.json`` in its own process group with a deadline,
and reads one JSON result that the child (`tuner._trials.worker`) writes atomically. Whatever the
model does (run out of memory, crash, hang) ends that process only. A multi-rank trial
(``trainer.devices`` > 1) is the same command: Lightning starts ranks 1..N-1 from it, in its process
group, each writes its own result, and the parent merges them (`merge_ranks`).

The parent-side names below load `tuner._trials.runner` on first use (PEP 562): the child imports
this package too, and every second it spends importing the parent side is a second of its
deadline gone before it arms its hang report.
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
