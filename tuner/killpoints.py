"""A test hook: ``RECOMPUTE_TUNE_TEST_KILL_AT=<point>`` makes `recompute-tune` SIGKILL itself at that point.

The fault-injection test (``tests/tuner/test_liveness.py``) uses it to kill a session at a
chosen point as ``kill -9`` would, then checks that the next run recovers. The points:

- ``profiling``: while setting the study up, before the profile is taken;
- ``trial``: while a trial's worker process runs;
- ``between``: after a trial was told and recorded, before the next is asked;
- ``gate``: as the evidence gate starts a measurement;
- ``after_write``: right after the policy file was written, before the promotion is recorded;
- ``rollback``: in a rollback, after its decision run started, before the policy file is replaced.

Unset (always, outside that test) it does nothing.
"""

from __future__ import annotations

import os
import signal

__all__ = ["ENV", "POINTS", "kill_point"]

ENV = "RECOMPUTE_TUNE_TEST_KILL_AT"
POINTS = ("profiling", "trial", "between", "gate", "after_write", "rollback")


def kill_point(point: str) -> None:
    """SIGKILL this process (its process group when it leads one) if ``ENV`` names ``point``."""
    if not point or os.environ.get(ENV) != point:
        return
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
