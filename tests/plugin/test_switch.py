"""Switching policies between batches: the model is restored exactly, and training is unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch

from lightning_recompute import RecomputeCallback, RecomputeError, RecomputePolicy, apply_policy, remove_policy
from lightning_recompute.reference import ReferenceGPT, SyntheticTokens

TINY = dict(vocab_size=64, seq_len=16, n_layer=3, n_embd=32, n_head=4, dropout=0.1)
DATA = dict(vocab_size=64, seq_len=16, batch_size=4, num_batches=8)
POLICIES = [
    RecomputePolicy.uniform("none"),
    RecomputePolicy.uniform("full"),
    RecomputePolicy.from_modes({"blocks.0": "full", "blocks.1": "selective", "blocks.2": "offload"}),
    RecomputePolicy.uniform("selective"),
]


def _instance_state(model: torch.nn.Module) -> dict[str, dict[str, int]]:
    """Each module's instance attributes, by identity: what a policy adds or replaces shows here."""
    return {name: {k: id(v) for k, v in vars(m).items()} for name, m in model.named_modules()}


@pytest.mark.parametrize("policy", POLICIES[1:], ids=lambda p: p.short(["blocks.0", "blocks.1", "blocks.2"]))
def test_removing_a_policy_restores_every_module_exactly(policy: RecomputePolicy) -> None:
    model = ReferenceGPT(**TINY)
    before = _instance_state(model)
    apply_policy(model, policy)
    assert _instance_state(model) != before
    assert remove_policy(model) == policy
    assert _instance_state(model) == before
    # And switching through every policy and back is the same as never applying one.
    for p in POLICIES:
        apply_policy(model, p)
    remove_policy(model)
    assert _instance_state(model) == before


class _Rotate(L.Callback):
    """Switches to the next policy after every batch, as a race does."""

    def __init__(self, recompute: RecomputeCallback) -> None:
        self.recompute = recompute
        self.turn = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.turn += 1
        self.recompute.switch_policy(pl_module, POLICIES[self.turn % len(POLICIES)])


def test_switching_every_batch_trains_bitwise_as_without_recompute(quiet_trainer: Callable[..., L.Trainer]) -> None:
    def fit(rotate: bool) -> tuple[ReferenceGPT, RecomputeCallback]:
        L.seed_everything(0, verbose=False)
        model = ReferenceGPT(**TINY)
        cb = RecomputeCallback(POLICIES[0], memory_steps={1, 2, 3, 4, 5})
        callbacks: list[L.Callback] = [cb, _Rotate(cb)] if rotate else [cb]
        quiet_trainer(max_steps=6, callbacks=callbacks).fit(model, SyntheticTokens(**DATA))
        return model, cb

    plain, _ = fit(rotate=False)
    rotated, cb = fit(rotate=True)
    for (name, p), q in zip(rotated.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), name
    # Each batch says which policy it ran under, in turn.
    assert [r.policy for r in cb.records] == [POLICIES[i % 4].fingerprint() for i in range(6)]
    peaks = {r.policy: r.peak_bytes for r in cb.records if r.step >= 1}
    assert peaks[POLICIES[1].fingerprint()] < peaks[POLICIES[0].fingerprint()]


def test_switching_while_a_batch_runs_is_refused() -> None:
    cb = RecomputeCallback(POLICIES[0])
    cb._step = 3  # what on_train_batch_start sets until the batch ends
    with pytest.raises(RecomputeError, match="between batches"):
        cb.switch_policy(ReferenceGPT(**TINY), POLICIES[1])
