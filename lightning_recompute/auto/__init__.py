"""Tuning inside the training job: `AutoRecompute` races the planner's candidates on the job's first steps
(every one a training step) and trains on with the winner. See docs/AUTO.md.
"""

from __future__ import annotations

from lightning_recompute.auto.callback import AUTO_PLAN, AutoDecision, AutoRecompute
from lightning_recompute.auto.candidates import Candidate

__all__ = ["AUTO_PLAN", "AutoDecision", "AutoRecompute", "Candidate"]
