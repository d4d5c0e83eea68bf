"""The peak memory of one real training step under a policy, the one way trials, benchmarks and tests ask it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import lightning as L
from torch.utils.data import DataLoader, Dataset

from lightning_recompute.callback import RecomputeCallback
from lightning_recompute.layers import LayerSpec
from lightning_recompute.policy import PolicyLike

QUIET_TRAINER: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
"""The ``Trainer`` keywords of a measurement run: no logger, checkpoint, progress bar or summary."""


def step_peak(
    model: L.LightningModule,
    data: L.LightningDataModule | DataLoader | Sequence[Any],
    policy: PolicyLike,
    *,
    step: int = 1,
    layers: LayerSpec = "auto",
    free_grads_at_batch_start: bool | None = None,
    accelerator: str = "cpu",
) -> int:
    """Fit ``model`` (in place) for ``step + 1`` optimizer steps under ``policy`` and return the peak tensor bytes
    of step ``step`` (by default the first with optimizer state, as trials meter) as the callback's meter counts
    them. ``data`` is a LightningDataModule, the train DataLoader, or a list of batches (kept alive, so counted);
    ``layers`` and ``free_grads_at_batch_start`` are as for `RecomputeCallback`.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    callback = RecomputeCallback(
        policy, layers=layers, memory_steps=range(step + 1), free_grads_at_batch_start=free_grads_at_batch_start
    )
    trainer = L.Trainer(accelerator=accelerator, devices=1, max_steps=step + 1, callbacks=[callback], **QUIET_TRAINER)
    if isinstance(data, L.LightningDataModule):
        trainer.fit(model, datamodule=data)
    else:  # a list of batches is a map-style dataset
        loader = data if isinstance(data, DataLoader) else DataLoader(cast(Dataset[Any], data), batch_size=None)
        trainer.fit(model, train_dataloaders=loader)
    peaks = [r.peak_bytes for r in callback.records if r.step == step and r.peak_bytes is not None]
    if not peaks:
        raise RuntimeError(f"the fit stopped after {trainer.global_step} steps, before step {step} was measured")
    return max(peaks)
