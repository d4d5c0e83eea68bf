"""The peak memory of one real training step under a policy: a short Lightning fit, metered by the callback.

The tuner's trials, its benchmarks and its tests all ask "what does this policy peak at on this
model and batch?". Asked through three hand-written Trainer loops, the answer drifted (one loop
kept the previous step's gradients alive through the forward, the others freed them, and the peaks
differed by the gradients' bytes). This is the one way to ask it: a `RecomputeCallback` fit of
``step + 1`` steps in Lightning's own order, metered from the first step on as a tuner trial meters
(a ledger switched on at the second step counts 4 bytes fewer on the reference model than the
trial's), with the callback's own choice of when gradients are freed unless the
caller overrides it.
"""

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
    """Fit ``model`` for ``step + 1`` optimizer steps under ``policy`` and return the peak of step ``step``.

    Args:
        model: the LightningModule; it is trained in place (pass a copy to keep the original).
        data: a LightningDataModule, the train DataLoader, or a list of batches (each given to
            ``training_step`` as it is; the list keeps them all alive, so the peak counts them).
        policy: anything `RecomputeCallback` accepts as a policy.
        step: the global step whose peak is returned. The default, the second step, is the first
            with the optimizer's state allocated: the steady peak of a training job, and the step
            a tuner trial meters.
        layers: which modules are layers, as for `RecomputeCallback`.
        free_grads_at_batch_start: as for `RecomputeCallback`; ``None`` is the callback's own
            decision (on where it cannot change training), so the peak is the one a job with the
            callback sees. ``False`` keeps the previous step's gradients alive through the forward,
            as Lightning does without the callback.
        accelerator: the Trainer's accelerator (one device).

    Returns:
        The peak tensor bytes of that step on the device, as the callback's meter counts them.

    Raises:
        ValueError: ``step`` is negative.
        RuntimeError: the fit stopped before step ``step`` (a callback or the model asked it to stop).
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    callback = RecomputeCallback(
        policy, layers=layers, memory_steps=range(step + 1), free_grads_at_batch_start=free_grads_at_batch_start
    )
    trainer = L.Trainer(accelerator=accelerator, devices=1, max_steps=step + 1, callbacks=[callback], **QUIET_TRAINER)
    if isinstance(data, L.LightningDataModule):
        trainer.fit(model, datamodule=data)
    elif isinstance(data, DataLoader):
        trainer.fit(model, train_dataloaders=data)
    else:
        # A list of batches is a map-style dataset (it has __getitem__ and __len__); torch types only Dataset.
        trainer.fit(model, train_dataloaders=DataLoader(cast(Dataset[Any], data), batch_size=None))
    peaks = [r.peak_bytes for r in callback.records if r.step == step and r.peak_bytes is not None]
    if not peaks:
        raise RuntimeError(f"the fit stopped after {trainer.global_step} steps, before step {step} was measured")
    # With gradient accumulation a step has several micro-batches; the step's peak is their maximum.
    return max(peaks)
