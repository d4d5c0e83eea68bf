"""The race itself: candidate policies measured in turn on one model in one Lightning fit (in a trial worker)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch

from lightning_recompute import QUIET_TRAINER, RecomputeCallback, RecomputePolicy
from lightning_recompute.race.plan import RacePlan
from lightning_recompute.race.schedule import RaceSchedule, Turn

__all__ = ["RacePlan", "race"]


class _Race(RecomputeCallback):
    """Runs the schedule's turns in a fit, one step each."""

    def __init__(self, schedule: RaceSchedule, layers: Any) -> None:
        super().__init__(schedule.entrants[schedule.order[0]].policy, layers=layers, memory_steps=frozenset())
        self.schedule = schedule
        self.turn: Turn | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._advance(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        r = self.records[-1]
        if self.turn is not None:
            self.schedule.check(self.turn, r)
            self.schedule.record(self.turn, r.seconds, r.peak_bytes, tokens=r.tokens, samples=r.samples)
        self._advance(trainer, pl_module)

    def _advance(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.turn = self.schedule.next_turn()
        if self.turn is None:
            trainer.should_stop = True
        else:
            self.schedule.put_on(self.turn, self, trainer, pl_module)


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
    """Race ``entrants`` (``(key, policy, short)``, keys unique) on ``model``, trained in place on ``datamodule``
    (a finite one is cycled), and return the `RaceResult` as a dict.

    ``references`` are the keys the winner's "vs" figures are about; an entrant whose metered peak exceeds
    ``budget_bytes`` is out at once; ``trainer_kwargs`` are more ``Trainer`` arguments (accelerator, precision).
    """
    plan = plan or RacePlan()
    kwargs = dict(trainer_kwargs or {})
    accelerator = str(kwargs.pop("accelerator", "cpu"))
    on_cuda = accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available())
    schedule = RaceSchedule(entrants, references, plan, budget_bytes, meter_every_step=on_cuda, device=accelerator)
    per_round = len(entrants) * (plan.steps + 1)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=plan.warmup_steps + per_round * (plan.max_rounds + plan.estimate_rounds) + 1,
        max_epochs=-1,  # a short data module cycles
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[_Race(schedule, layers)],
        **QUIET_TRAINER,
        **kwargs,
    )
    trainer.fit(model, datamodule=datamodule)
    return schedule.result().to_dict()
