"""Helpers every test package shares: the repository's root and the environment of a child interpreter."""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
"""The repository's root (the folder holding ``tests/``, ``tuner/`` and ``recipes/``)."""

RACE_PLAN_ENV = "RECOMPUTE_TUNE_RACE_PLAN"
"""`tuner.recipe._schema.RACE_PLAN_ENV` (not imported: tests of the library alone must not import the service)."""

SHORT_RACE = {"min_rounds": 4, "max_rounds": 8, "estimate_rounds": 6, "time_s": 20.0}
"""The race of tests that run whole sessions (`RACE_PLAN_ENV`, set by `child_env`): every path of the race,
a fraction of its default length (the race's statistics are tested with exact figures in tests/tuner/race)."""


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child interpreter: the repository importable (so ``tests.*``
    class paths resolve), output unbuffered (so a test reading a pipe sees lines as they come), a short
    race (`SHORT_RACE`), and ``extra`` on top."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env[RACE_PLAN_ENV] = json.dumps(SHORT_RACE)
    env.update(extra)
    return env


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (Linux ``/proc``): a zombie has already died, it only awaits its reaping."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
