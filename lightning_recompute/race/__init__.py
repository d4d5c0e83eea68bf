"""Deciding between candidate policies on evidence that survives a noisy machine.

A trial is one short measurement in its own process, minutes from the others: on a machine whose
load moves it ranks noise. A race measures the leading candidates again, interleaved on one model
in one process, round after round, until the leader is separated from the rest with confidence or
its time is spent; ties within noise are ties, broken by headroom and then less recomputation, and
the winner's "vs" figures come from fresh rounds with their intervals.

- `stats`: a sample's spread; the paired-ratio interval (why these statistics);
- `rule`: standing, tie and tie-break over per-round times (pure);
- `plan`: `RacePlan`, how long and how sure;
- `schedule`: `RaceSchedule`, the turns and the decision, fed one step at a time;
- `engine`: the schedule run in a Lightning fit (runs in a trial worker);
- `result`: `RaceResult`, what the parent reads, with the figures' wording;
- `machine`: the machine's state beside a measurement;
- `neighbour`: a seeded noisy neighbour, for tests and benchmarks.

The parent side (`tuner._trials.run_race`) starts the worker.
"""

from __future__ import annotations

from lightning_recompute.race.plan import RacePlan
from lightning_recompute.race.result import RaceEntrant, RaceResult, format_gain
from lightning_recompute.race.stats import Interval, Spread, paired_ratio, spread

__all__ = ["Interval", "RaceEntrant", "RacePlan", "RaceResult", "Spread", "format_gain", "paired_ratio", "spread"]
