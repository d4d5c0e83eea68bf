"""RecomputeCallback inside Lightning's training loop features: gradient accumulation and clipping."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_recompute import RecomputeCallback, RecomputePolicy
from lightning_recompute.reference import ReferenceGPT, SyntheticTokens

TINY = dict(vocab_size=64, seq_len=16, n_layer=3, n_embd=32, n_head=4, dropout=0.1, learning_rate=1e-2)
DATA = dict(vocab_size=64, seq_len=16, batch_size=2, num_batches=16)
MIXED = RecomputePolicy.from_modes({"blocks.0": "full", "blocks.1": "selective"})


def _fit(
    make: Callable[..., L.Trainer], tmp_path: Path, policy: RecomputePolicy, name: str
) -> tuple[ReferenceGPT, RecomputeCallback, list[dict]]:
    L.seed_everything(0, verbose=False)
    model = ReferenceGPT(**TINY)
    cb = RecomputeCallback(policy)
    trainer = make(
        max_steps=2,
        accumulate_grad_batches=4,
        gradient_clip_val=0.05,  # small enough that every step is clipped
        logger=CSVLogger(tmp_path, name=name, version=0),
        log_every_n_steps=1,
        callbacks=[cb],
    )
    trainer.fit(model, SyntheticTokens(**DATA))
    with open(tmp_path / name / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("recompute/step_time_s")]
    return model, cb, rows


def test_accumulation_and_clipping_bitwise_equal_and_one_record_per_micro_batch(
    quiet_trainer: Callable[..., L.Trainer], tmp_path: Path
) -> None:
    plain, plain_cb, _ = _fit(quiet_trainer, tmp_path, RecomputePolicy.uniform("none"), "none")
    model, cb, rows = _fit(quiet_trainer, tmp_path, MIXED, "mixed")
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), name
    # One record per training batch (micro-batch), tagged with the optimizer step it belongs to.
    assert [r.step for r in cb.records] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(r.samples == 2 and r.tokens == 32 for r in cb.records)
    # The logger gets one row per optimizer step: the figures of that step's last micro-batch,
    # the one that also ran the clipping and the optimizer.
    assert [int(r["step"]) for r in rows] == [0, 1]
    for row, record in zip(rows, (cb.records[3], cb.records[7]), strict=True):
        assert float(row["recompute/peak_memory_bytes"]) == record.peak_bytes
    # Recomputing two of three blocks never raises a micro-batch's peak and lowers it where the
    # blocks' activations, not the gradients or AdamW's state, set it.
    mine = [r.peak_bytes for r in cb.records]
    theirs = [r.peak_bytes for r in plain_cb.records]
    assert all(a is not None and b is not None and a <= b for a, b in zip(mine, theirs, strict=True))
    assert mine != theirs
