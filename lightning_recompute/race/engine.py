"""The race itself: candidate policies measured in turn on one model in one Lightning fit (in a trial worker).

`RecomputeCallback.switch_policy` puts each turn's policy on between steps; the schedule is `race.schedule`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch

from lightning_recompute import QUIET_TRAINER, RecomputeCallback, RecomputePolicy
from lightning_recompute.race.machine import machine_state
from lightning_recompute.race.plan import RacePlan
from lightning_recompute.race.schedule import RaceSchedule, Turn

__all__ = ["race"]


class _Race(L.Callback):
    """Runs the schedule's turns in a fit (placed after `RecomputeCallback`, whose `StepRecord` it reads)."""

    def __init__(self, recompute: RecomputeCallback, schedule: RaceSchedule) -> None:
        self.recompute = recompute
        self.schedule = schedule
        self.current: Turn | None = None
        self.active = schedule.order[0]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._advance(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        record = self.recompute.records[-1]
        turn = self.current
        if turn is not None and turn.phase != "warmup":
            expected = self.schedule.entrants[turn.key].policy.fingerprint()
            if record.policy != expected:
                raise RuntimeError(f"race: step {record.step} ran policy {record.policy}, but the turn was {expected}")
            self.schedule.record(turn, record.seconds, record.peak_bytes, tokens=record.tokens, samples=record.samples)
        self._advance(trainer, pl_module)

    def _advance(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        turn = self.schedule.next_turn()
        self.current = turn
        if turn is None:
            trainer.should_stop = True
            return
        if turn.key != self.active:
            self.recompute.switch_policy(pl_module, self.schedule.entrants[turn.key].policy)
            self.active = turn.key
        self.recompute.memory_steps = frozenset({trainer.global_step}) if turn.metered else frozenset()


def race(
    model: L.LightningModule,
    datamodule: L.LightningDataModule,
    entrants: Sequence[tuple[str, RecomputePolicy, str]],
    *,
    references: Sequence[str] = (),
    plan: RacePlan | None = None,
    budget_bytes: int | None = None,
    layers: Any = "auto",
    trainer_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Race ``entrants`` (``(key, policy, short)``, at least one) on ``model`` and return what happened.

    Args:
        model: the LightningModule, freshly built; it is trained in place.
        datamodule: its data (a finite one is cycled).
        entrants: the candidates, each with a unique key and its glyphs.
        references: keys of the entrants the winner's "vs" figures are about.
        plan: how long and how sure (`RacePlan`).
        budget_bytes: an entrant whose metered peak exceeds it is out at once.
        layers: which modules are layers, as for `RecomputeCallback`.
        trainer_kwargs: more ``Trainer`` arguments (accelerator, precision, strategy).

    Returns:
        The JSON-ready race record (`RaceSchedule.result`) with the outcome, wall time, machine state and plan.
    """
    plan = plan or RacePlan()
    kwargs = dict(trainer_kwargs or {})
    accelerator = str(kwargs.pop("accelerator", "cpu"))
    schedule = RaceSchedule(
        entrants,
        references,
        plan,
        budget_bytes,
        meter_every_step=accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available()),
    )
    recompute = RecomputeCallback(entrants[0][1], layers=layers, memory_steps=frozenset())
    racer = _Race(recompute, schedule)
    per_round = len(entrants) * (plan.steps + 1)
    bound = plan.warmup_steps + per_round * (plan.max_rounds + plan.estimate_rounds) + 1
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=bound,
        max_epochs=-1,  # a short data module cycles
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[recompute, racer],
        **QUIET_TRAINER,
        **kwargs,
    )
    before = machine_state(accelerator)
    began = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    out = schedule.result()
    out.update(
        outcome="ok",
        wall_s=time.perf_counter() - began,
        machine_before=before,
        machine_after=machine_state(accelerator),
        plan=plan.to_dict(),
    )
    return out
