"""Tuning inside the training job, on its first steps (docs/AUTO.md)."""

from __future__ import annotations

from lightning_recompute.auto.callback import AUTO_PLAN, AutoDecision, AutoRecompute, Candidate

__all__ = ["AUTO_PLAN", "AutoDecision", "AutoRecompute", "Candidate"]
