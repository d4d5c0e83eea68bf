"""Deciding between candidate policies on evidence that survives a noisy machine: the race (docs/TUNER.md)."""

from __future__ import annotations

from lightning_recompute.race.result import RaceEntrant, RaceResult, format_gain
from lightning_recompute.race.rule import RacePlan
from lightning_recompute.race.stats import Interval, Spread, paired_ratio, spread

__all__ = ["Interval", "RaceEntrant", "RacePlan", "RaceResult", "Spread", "format_gain", "paired_ratio", "spread"]
