"""torch.compile with recomputation: the whole model compiled before fit, or each block (torchtitan style).

What is guaranteed, and tested: under the same compile setup, the weights after training with any
policy are bitwise equal to the weights without recomputation, with dropout off (with dropout on
under compile no bitwise claim is made). On CPU the
callback reports no peak for compiled models (the storage ledger cannot see compiled allocations).
"""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import pytest
import torch

from lightning_recompute import RecomputeCallback, RecomputePolicy
from lightning_recompute.reference import ReferenceGPT, SyntheticTokens

MIXED = RecomputePolicy.from_modes({"blocks.0": "full", "blocks.1": "selective"})


def _fit(
    make: Callable[..., L.Trainer], policy: RecomputePolicy, how: str, backend: str
) -> tuple[dict, RecomputeCallback]:
    torch._dynamo.reset()
    L.seed_everything(0, verbose=False)
    model = ReferenceGPT(vocab_size=64, seq_len=16, n_layer=2, n_embd=32, n_head=4, dropout=0.0, learning_rate=1e-2)
    if how == "per-block":
        for block in model.blocks:
            block.compile(backend=backend)
        fitted: torch.nn.Module = model
    else:
        fitted = torch.compile(model, backend=backend)
    cb = RecomputeCallback(policy)
    trainer = make(max_steps=2, callbacks=[cb], limit_val_batches=0)
    with pytest.warns(UserWarning, match="recompute/peak_memory_bytes is not logged"):
        trainer.fit(fitted, SyntheticTokens(vocab_size=64, seq_len=16, batch_size=2, num_batches=4))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, cb


def _check(make: Callable[..., L.Trainer], how: str, backend: str, modes: list[str]) -> None:
    reference, _ = _fit(make, RecomputePolicy.uniform("none"), how, backend)
    for mode in modes:
        policy = MIXED if mode == "mixed" else RecomputePolicy.uniform(mode)
        weights, cb = _fit(make, policy, how, backend)
        assert [r.peak_bytes for r in cb.records] == [None, None]
        for key in weights:
            assert torch.equal(weights[key], reference[key]), (mode, key)


def test_per_block_compile_every_mode_bitwise(quiet_trainer: Callable[..., L.Trainer]) -> None:
    # aot_eager: the same Dynamo capture and AOTAutograd partitioning as Inductor, without its code
    # generation, which costs a minute a graph on CPU (the Inductor run is the slow test below).
    # Each block is compiled on its own, so the mixed policy (blocks.0 full, blocks.1 selective)
    # compiles and trains a full block and a selective block: the same graphs uniform full and
    # uniform selective would make, without two more fits.
    _check(quiet_trainer, "per-block", "aot_eager", ["mixed"])


@pytest.mark.slow
def test_whole_model_compiled_with_inductor_bitwise() -> None:
    # A plain loop, not a Trainer: under torch 2.13, Dynamo fails inside Lightning's own self.log
    # when Inductor compiles a whole LightningModule given to fit (seen even under an all-none policy).
    from lightning_recompute import apply_policy

    def train(policy: RecomputePolicy | None) -> dict[str, torch.Tensor]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = ReferenceGPT(vocab_size=64, seq_len=16, n_layer=2, n_embd=32, n_head=4, dropout=0.0)
        if policy is not None:
            apply_policy(model, policy)
        compiled = torch.compile(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            x, y = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(compiled(x).view(-1, 64), y.view(-1)).backward()
            opt.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    reference, weights = train(None), train(MIXED)
    for key in weights:
        assert torch.equal(weights[key], reference[key]), key


@pytest.mark.parametrize("kind", ["batchnorm", "spectral", "counter"])
def test_per_block_compile_updates_buffers_once(quiet_trainer: Callable[..., L.Trainer], kind: str) -> None:
    """Layers whose forward updates buffers, compiled per block: Dynamo either traces the checkpoint
    (whose compiled recomputation writes nothing) or runs it eagerly (where the replay restores them)."""
    from tests.plugin.stateful_models import StatefulNet, differing, images, state

    def fit(policy: RecomputePolicy | None) -> dict[str, torch.Tensor]:
        torch._dynamo.reset()
        L.seed_everything(0, verbose=False)
        model = StatefulNet(kind)
        for block in model.blocks:
            block.compile(backend="aot_eager")
        callbacks = [] if policy is None else [RecomputeCallback(policy)]
        quiet_trainer(max_steps=3, callbacks=callbacks, limit_val_batches=0).fit(model, images())
        return state(model)

    plain = fit(None)
    trained = fit(RecomputePolicy.from_modes({"blocks.0": "full", "blocks.1": "selective", "blocks.2": "none"}))
    assert not differing(plain, trained)
