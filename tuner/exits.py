"""The exit codes of ``recompute-tune``, defined once for the CLI and the summaries it prints."""

from __future__ import annotations

from lightning_recompute.errors import RecomputeError

__all__ = ["EXIT_BAD_INPUT", "EXIT_INFEASIBLE", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_STORE_FAILED", "StoreFailure"]

EXIT_OK = 0
"""The output policy file holds the study's best feasible policy (promoted now, or already)."""
EXIT_INFEASIBLE = 1
"""Nothing promoted: no trial fitted the budget, the gate kept the current policy, or nothing to roll back to."""
EXIT_BAD_INPUT = 2
"""The recipe or an argument is invalid (the CLI prints every problem)."""
EXIT_STORE_FAILED = 3
"""A store failed: the study storage or tracking store (damaged file, unreachable, not MLflow) or the output's
folder or disk (read-only, full). Nothing was promoted and nothing stored was removed; the message names the
store and what to do. Distinct from 1 so a scheduled job can tell "needs a person" from "nothing fits"."""
EXIT_INTERRUPTED = 130
"""Stopped by Ctrl-C, SIGTERM or SIGHUP (a closed terminal); the study resumes on the next run."""


class StoreFailure(RecomputeError):
    """A store a command reads or writes failed: the study storage, the tracking store, or the output folder.

    The CLI prints the message alone (no traceback) and exits `EXIT_STORE_FAILED`; `tuner.stores.store_failure`
    makes one from what a store raised.
    """

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key
        """The recipe key naming the store: ``study.storage``, ``tracking.uri``, ``output`` (or ``disk``)."""
