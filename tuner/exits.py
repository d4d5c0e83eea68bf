"""The exit codes of ``recompute-tune`` and the errors that carry them, defined once for every subcommand.

Every error a command raises on purpose is a `RecomputeError`; the CLI has one handler, which prints
the message (no traceback) and exits with `exit_code_of` it:

- `StoreFailure`: `EXIT_STORE_FAILED` (3), a store needs a person;
- `Declined`: `EXIT_INFEASIBLE` (1), the command ran and changed nothing (nothing to roll back to, a
  rollback refused, the gate's lease held by another worker past the wait);
- any other `RecomputeError` (`tuner.recipe.RecipeError`, `tuner._preflight.SettingsError`, a layer
  not found, a planner error ...): `EXIT_BAD_INPUT` (2), what was asked cannot be done as written.

A tuning session that ends without a promotion is no error: its summary carries `EXIT_INFEASIBLE`.
Ctrl-C, SIGTERM and SIGHUP exit `EXIT_INTERRUPTED`.
"""

from __future__ import annotations

from typing import ClassVar

from lightning_recompute.errors import RecomputeError

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_INFEASIBLE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_STORE_FAILED",
    "Declined",
    "StoreFailure",
    "TunerError",
    "exit_code_of",
]

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


class TunerError(RecomputeError):
    """An error of a tuner command that says which exit code it ends the command with."""

    exit_code: ClassVar[int] = EXIT_BAD_INPUT


class Declined(TunerError):
    """The command ran and changed nothing on purpose: nothing to roll back to, a rollback refused, another
    worker's gate held the study past the wait."""

    exit_code: ClassVar[int] = EXIT_INFEASIBLE


def exit_code_of(err: RecomputeError) -> int:
    """The exit code a command ends with when it raises ``err``."""
    return err.exit_code if isinstance(err, TunerError) else EXIT_BAD_INPUT


class StoreFailure(TunerError):
    """A store a command reads or writes failed: the study storage, the tracking store, or the output folder.

    The CLI prints the message alone (no traceback) and exits `EXIT_STORE_FAILED`; `tuner._stores.store_failure`
    makes one from what a store raised.
    """

    exit_code: ClassVar[int] = EXIT_STORE_FAILED

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key
        """The recipe key naming the store: ``study.storage``, ``tracking.uri``, ``output`` (or ``disk``)."""
