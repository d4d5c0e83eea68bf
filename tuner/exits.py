"""The exit codes of ``recompute-tune``, defined once for the CLI and the summaries it prints."""

from __future__ import annotations

__all__ = ["EXIT_BAD_INPUT", "EXIT_INFEASIBLE", "EXIT_INTERRUPTED", "EXIT_OK"]

EXIT_OK = 0
"""The output policy file holds the study's best feasible policy (promoted now, or already)."""
EXIT_INFEASIBLE = 1
"""Nothing promoted: no trial fitted the budget, the gate kept the current policy, or nothing to roll back to."""
EXIT_BAD_INPUT = 2
"""The recipe or an argument is invalid (the CLI prints every problem)."""
EXIT_INTERRUPTED = 130
"""Stopped by Ctrl-C, SIGTERM or SIGHUP (a closed terminal); the study resumes on the next run."""
