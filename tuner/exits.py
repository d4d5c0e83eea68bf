"""The exit codes of ``recompute-tune`` and the errors that carry them, defined once for every subcommand.

Every error a command raises on purpose is a `RecomputeError`; the CLI has one handler, which prints
the message (no traceback) and exits with `exit_code_of` it:

- `StoreFailure`: `EXIT_STORE_FAILED` (3), a store needs a person;
- `Declined`: `EXIT_INFEASIBLE` (1), the command ran and changed nothing (nothing to roll back to, a
  rollback refused, the gate's lease held by another worker past the wait);
- any other `RecomputeError` (`tuner.recipe.RecipeError`, `tuner.preflight.SettingsError`, a layer
  not found, a planner error ...): `EXIT_BAD_INPUT` (2), what was asked cannot be done as written.

A tuning session that ends without a promotion is no error: its summary carries `EXIT_INFEASIBLE`.
Ctrl-C, SIGTERM and SIGHUP exit `EXIT_INTERRUPTED`.
"""

from __future__ import annotations

from typing import ClassVar
from urllib.parse import urlsplit

from lightning_recompute.errors import RecomputeError, clip

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_INFEASIBLE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_STORE_FAILED",
    "Declined",
    "StoreFailure",
    "TunerError",
    "driver_missing",
    "exit_code_of",
    "hide_password",
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

    The CLI prints the message alone (no traceback) and exits `EXIT_STORE_FAILED`; `tuner.stores.store_failure`
    makes one from what a store raised.
    """

    exit_code: ClassVar[int] = EXIT_STORE_FAILED

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key
        """The recipe key naming the store: ``study.storage``, ``tracking.uri``, ``output`` (or ``disk``)."""


def driver_missing(key: str, url: str, err: ImportError) -> str:
    """The message for a database URL whose Python driver is not installed."""
    shown = clip(hide_password(url))
    if url.startswith("postgresql"):
        return f"{key}: {shown} needs psycopg: pip install 'lightning-recompute[postgres]'"
    return f"{key}: {shown} needs a database driver that is not installed ({err})"


def hide_password(url: str) -> str:
    """``url`` with any password replaced by ``***``, for messages."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):  # not a URL SQLAlchemy parses: hide what looks like user:password@
        parts = urlsplit(url)
        if parts.password is None:
            return url
        return url.replace(f":{parts.password}@", ":***@", 1)
