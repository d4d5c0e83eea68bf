"""Tuning inside the training job: `AutoRecompute`, a callback that races the planner's candidates on
the job's first steps (every one a training step) and trains on with the winner.

- `callback`: `AutoRecompute` (the Lightning hooks, the race in the job, out-of-memory retries, ranks agreeing);
- `candidates`: what races (the planner's, from a profile of the job's first batch; uniform; given);
- `retry`: `StepRetry`, a step run again after an out-of-memory error in it;
- `record`: the policy file and the MLflow record, in a tuning session's layout.
"""

from __future__ import annotations

from lightning_recompute.auto.callback import AUTO_PLAN, AutoDecision, AutoRecompute
from lightning_recompute.auto.candidates import Candidate

__all__ = ["AUTO_PLAN", "AutoDecision", "AutoRecompute", "Candidate"]
