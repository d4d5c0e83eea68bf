"""RecomputeCallback frees the previous step's gradients at batch start where that cannot change
training: same loss and weights bit for bit, a peak lower by exactly the gradient bytes when the
peak is in the forward (and the planner predicts that drop), off under accumulation and manual
optimisation, and the fit-start log line says which applies."""

from __future__ import annotations

import copy
import logging
from typing import Any, cast

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_recompute import QUIET_TRAINER, RecomputeCallback, RecomputeError, RecomputePolicy
from lightning_recompute.reference import ReferenceGPT

B, T, V = 2, 16, 32


class _BufferedGPT(ReferenceGPT):
    """ReferenceGPT whose forward first builds a large per-step buffer without gradients (as a mask or
    bias rebuilt every step would be), so the step's peak is in the forward, where the previous step's
    gradients are alive in Lightning's order."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            buffer = torch.zeros(idx.size(0), idx.size(1), 16384)  # 2 MiB: more than every activation
            del buffer
        return super().forward(idx)


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        if isinstance(outputs, dict) and "loss" in outputs:  # manual optimisation returns none
            self.losses.append(outputs["loss"].detach().clone())


def _batches(n: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(n):
        x = torch.randint(0, V, (B, T), generator=g)
        batches.append((x, x.roll(-1, 1)))
    # A list of batches is a map-style dataset (it has __getitem__ and __len__); torch types only Dataset.
    return DataLoader(cast(Dataset[Any], batches), batch_size=None)


def _fit(
    model: L.LightningModule, flag: bool | None, steps: int = 3, **trainer_kwargs: Any
) -> tuple[L.LightningModule, RecomputeCallback, _Losses]:
    model = copy.deepcopy(model)
    cb = RecomputeCallback(RecomputePolicy.uniform("none"), memory_steps={1}, free_grads_at_batch_start=flag)
    losses = _Losses()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, callbacks=[cb, losses], **QUIET_TRAINER, **trainer_kwargs
    )
    torch.manual_seed(0)  # the same dropout masks in every run
    trainer.fit(model, _batches(steps * trainer_kwargs.get("accumulate_grad_batches", 1)))
    return model, cb, losses


def _buffered() -> _BufferedGPT:
    torch.manual_seed(0)
    return _BufferedGPT(vocab_size=V, seq_len=T, n_layer=2, n_embd=16, n_head=2, dropout=0.1)


@pytest.fixture(scope="module")
def runs() -> dict[bool | None, tuple[L.LightningModule, RecomputeCallback, _Losses]]:
    model = _buffered()
    return {flag: _fit(model, flag) for flag in (None, False)}


def test_same_loss_and_weights_bit_for_bit_with_dropout(runs) -> None:
    freed, kept = runs[None], runs[False]
    assert freed[1].grad_freeing is not None and freed[1].grad_freeing.enabled
    assert kept[1].grad_freeing is not None and not kept[1].grad_freeing.enabled
    assert len(freed[2].losses) == len(kept[2].losses) == 3
    for a, b in zip(freed[2].losses, kept[2].losses, strict=True):
        assert torch.equal(a, b)
    for (name, p), q in zip(freed[0].named_parameters(), kept[0].parameters(), strict=True):
        assert torch.equal(p, q), name


def test_peak_drops_by_exactly_the_gradient_bytes_and_the_planner_predicts_it(runs) -> None:
    from lightning_recompute.planner import Planner
    from lightning_recompute.profile import profile_model

    model = _buffered()  # one no Trainer is attached to (profiling runs its training_step alone)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    peak_freed, peak_kept = runs[None][1].records[1].peak_bytes, runs[False][1].records[1].peak_bytes
    assert peak_freed is not None and peak_kept is not None
    assert peak_kept - peak_freed == grad_bytes

    prof = profile_model(model, next(iter(_batches(1))), modes=["none"], repeats=1)
    assert prof.free_grads_at_batch_start and prof.forward_grad_bytes == grad_bytes
    policy = RecomputePolicy.uniform("none")
    on, off = Planner(prof).predict(policy), Planner(prof, free_grads_at_batch_start=False).predict(policy)
    assert on.peak_at == off.peak_at == "fixed:step->fwd_start:0"  # the buffer, in the forward
    assert off.peak_bytes - on.peak_bytes == grad_bytes
    assert (on.peak_bytes, off.peak_bytes) == (peak_freed, peak_kept)


class _Manual(ReferenceGPT):
    def __init__(self) -> None:
        super().__init__(vocab_size=V, seq_len=T, n_layer=2, n_embd=16, n_head=2)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        opt = cast(torch.optim.Optimizer, self.optimizers())
        opt.zero_grad()
        self.manual_backward(self.loss(batch))
        opt.step()


class _ReadsGrads(ReferenceGPT):
    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        pass


@pytest.mark.parametrize(
    ("model", "kwargs", "reason"),
    [
        (
            ReferenceGPT(vocab_size=V, seq_len=T, n_layer=2, n_embd=16),
            {"accumulate_grad_batches": 2},
            "off (accumulate_grad_batches=2",
        ),
        (_Manual(), {}, "off (manual optimisation"),
        (ReferenceGPT(vocab_size=V, seq_len=T, n_layer=2, n_embd=16), {}, "off (free_grads_at_batch_start=False)"),
        (
            _ReadsGrads(vocab_size=V, seq_len=T, n_layer=2, n_embd=16),
            {},
            "off (_ReadsGrads.on_before_zero_grad runs before Lightning's zero_grad",
        ),
    ],
    ids=["accumulation", "manual", "flag", "hook"],
)
def test_off_where_it_could_change_training_and_the_log_says_why(
    model: L.LightningModule, kwargs: dict[str, Any], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    flag = False if reason.endswith("=False)") else None
    with caplog.at_level(logging.INFO):
        _, cb, _ = _fit(model, flag, steps=1, **kwargs)
    assert cb.grad_freeing is not None and not cb.grad_freeing.enabled
    assert f"RecomputeCallback: freeing gradients at batch start: {reason}" in caplog.text


def test_true_raises_where_it_would_change_training_and_overrides_a_hook() -> None:
    model = ReferenceGPT(vocab_size=V, seq_len=T, n_layer=2, n_embd=16)
    with pytest.raises(RecomputeError, match="accumulate_grad_batches=2"):
        _fit(model, True, steps=1, accumulate_grad_batches=2)
    _, cb, _ = _fit(_ReadsGrads(vocab_size=V, seq_len=T, n_layer=2, n_embd=16), True, steps=1)
    assert cb.grad_freeing is not None and cb.grad_freeing.enabled
    assert "free_grads_at_batch_start=True, though" in cb.grad_freeing.reason
