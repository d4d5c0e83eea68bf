"""The race itself: candidate policies measured in turn on one model in one Lightning fit (in a trial worker)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch

from lightning_recompute import QUIET_TRAINER, RecomputePolicy
from lightning_recompute.race.plan import RacePlan
from lightning_recompute.race.schedule import RaceCallback, RaceSchedule

__all__ = ["RacePlan", "race"]


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
    callback = RaceCallback(entrants[0][1], layers=layers, memory_steps=frozenset())
    callback.schedule = schedule
    per_round = len(entrants) * (plan.steps + 1)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=plan.warmup_steps + per_round * (plan.max_rounds + plan.estimate_rounds) + 1,
        max_epochs=-1,  # a short data module cycles
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[callback],
        **QUIET_TRAINER,
        **kwargs,
    )
    trainer.fit(model, datamodule=datamodule)
    return schedule.result().to_dict()
