"""`step_peak`: the one "peak of a training step" measurement, taken in the order the callback runs."""

from __future__ import annotations

import copy
from collections.abc import Callable

import lightning as L
import pytest

from lightning_recompute import RecomputeCallback, RecomputePolicy, step_peak
from lightning_recompute.reference import ReferenceGPT, SyntheticTokens

TINY = dict(vocab_size=64, seq_len=16, n_layer=3, n_embd=32, n_head=4, dropout=0.1)
DATA = dict(vocab_size=64, seq_len=16, batch_size=4, num_batches=4)
MIXED = RecomputePolicy.from_modes({"blocks.0": "full", "blocks.1": "selective"})


def _callback_peaks(make: Callable[..., L.Trainer], flag: bool | None) -> list[int | None]:
    """Every step's peak as a training job with the callback (metering every step) records it."""
    L.seed_everything(0, verbose=False)
    cb = RecomputeCallback(MIXED, free_grads_at_batch_start=flag)
    make(max_steps=3, callbacks=[cb]).fit(ReferenceGPT(**TINY), SyntheticTokens(**DATA))
    return [r.peak_bytes for r in cb.records]


@pytest.mark.parametrize("flag", [None, False])
def test_the_peak_is_the_callbacks_own_for_that_step(
    quiet_trainer: Callable[..., L.Trainer], flag: bool | None
) -> None:
    job = _callback_peaks(quiet_trainer, flag)
    for step in (0, 1):
        L.seed_everything(0, verbose=False)
        peak = step_peak(
            ReferenceGPT(**TINY), SyntheticTokens(**DATA), MIXED, step=step, free_grads_at_batch_start=flag
        )
        assert peak == job[step], (step, peak, job)
    # From the second step on the optimizer state exists and the peak is steady.
    assert job[1] == job[2] > job[0]


def test_gradients_kept_through_the_forward_raise_the_peak_by_at_most_their_bytes() -> None:
    model = ReferenceGPT(**TINY)
    freed = step_peak(copy.deepcopy(model), SyntheticTokens(**DATA), MIXED)
    kept = step_peak(copy.deepcopy(model), SyntheticTokens(**DATA), MIXED, free_grads_at_batch_start=False)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert freed < kept <= freed + grad_bytes


def test_a_list_of_batches_measures_as_its_dataloader_does_plus_the_batches_it_keeps_alive() -> None:
    import torch

    data = SyntheticTokens(**DATA)
    data.setup("fit")
    batches = list(data.train_dataloader())[:2]
    held = sum(t.numel() * t.element_size() for batch in batches for t in batch if isinstance(t, torch.Tensor))
    model = ReferenceGPT(**TINY)
    from_list = step_peak(copy.deepcopy(model), batches, MIXED)
    from_loader = step_peak(copy.deepcopy(model), SyntheticTokens(**DATA), MIXED)
    assert from_loader < from_list <= from_loader + held


def test_a_negative_step_is_refused() -> None:
    with pytest.raises(ValueError, match="step must be >= 0"):
        step_peak(ReferenceGPT(**TINY), SyntheticTokens(**DATA), MIXED, step=-1)
