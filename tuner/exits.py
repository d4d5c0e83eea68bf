"""The exit codes of ``recompute-tune`` (docs/TUNER.md) and the errors that carry them: the CLI prints a
`RecomputeError`'s message and exits with `exit_code_of` it."""

from __future__ import annotations

from typing import ClassVar

from lightning_recompute.errors import RecomputeError

EXIT_OK = 0  # the output policy file holds the study's best feasible policy (promoted now, or already)
EXIT_INFEASIBLE = 1  # nothing promoted: nothing fitted, the gate kept the current policy, nothing to roll back to
EXIT_BAD_INPUT = 2  # the recipe or an argument is invalid
EXIT_STORE_FAILED = 3  # a store failed: it needs a person; nothing promoted, nothing stored removed
EXIT_INTERRUPTED = 130  # Ctrl-C, SIGTERM or SIGHUP; the study resumes on the next run


class TunerError(RecomputeError):
    """An error that says which exit code it ends the command with."""

    exit_code: ClassVar[int] = EXIT_BAD_INPUT


class Declined(TunerError):
    """The command ran and changed nothing on purpose (nothing to roll back to, a rollback refused, another
    worker's gate held the study past the wait)."""

    exit_code: ClassVar[int] = EXIT_INFEASIBLE


class StoreFailure(TunerError):
    """A store a command reads or writes failed; ``key`` is the recipe key naming it (``study.storage``,
    ``tracking.uri``, ``output`` or ``disk``)."""

    exit_code: ClassVar[int] = EXIT_STORE_FAILED

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


def exit_code_of(err: RecomputeError) -> int:
    return err.exit_code if isinstance(err, TunerError) else EXIT_BAD_INPUT
