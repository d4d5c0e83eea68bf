"""Profiling a deep stack on meta from cuts of 3, 4 and 5 layers (`lightning_recompute.profile.extrapolate`): the
result equals stepping every layer, field by field, on our models and a Hugging Face one; a stack
the cuts cannot describe is stepped in full, and the profile says why."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from bench.llama_like import LlamaConfig, LlamaLike, token_batch
from lightning_recompute.profile import Profile, profile_meta
from lightning_recompute.reference import ReferenceGPT

DEPTH = 13  # the fewest layers the cuts are taken for (`MIN_LAYERS`)


def _same(a: Profile, b: Profile) -> None:
    da, db = a.to_dict(), b.to_dict()
    da.pop("notes")
    db.pop("notes")
    assert da.keys() == db.keys()
    for key in da:
        if key == "layers":
            for la, lb in zip(da[key], db[key], strict=True):
                assert la == lb, la["name"]
        else:
            assert da[key] == db[key], key


def _both(factory: Any, batch: Any, **kw: Any) -> tuple[Profile, Profile]:
    return (
        profile_meta(factory, batch, **kw),
        profile_meta(factory, batch, extrapolate=False, **kw),
    )


def _tokens(vocab: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))
    return x, x.roll(-1, 1)


def test_reference_gpt_with_dropout_every_mode_and_family() -> None:
    def factory() -> ReferenceGPT:
        return ReferenceGPT(vocab_size=64, seq_len=32, n_layer=DEPTH, n_embd=32, n_head=4, dropout=0.1)

    modes = ["none", "selective", "full", "offload", "selective:attn+wide"]
    cut, stepped = _both(factory, _tokens(64, 32), modes=modes, hardware="H100")
    _same(cut, stepped)
    assert len(cut.layers) == DEPTH and cut.layer_names == [f"blocks.{i}" for i in range(DEPTH)]
    assert any("cuts of 3, 4 and 5 layers" in n for n in cut.notes)
    assert not any("cuts of" in n for n in stepped.notes)


def test_llama_like_with_grouped_query_attention() -> None:
    cfg = LlamaConfig(vocab_size=128, dim=64, n_layers=DEPTH, n_heads=4, n_kv_heads=2, max_seq_len=64)
    cut, stepped = _both(lambda: LlamaLike(cfg), token_batch(2, 64, cfg.vocab_size), hardware="L4")
    _same(cut, stepped)
    assert any("cuts of 3, 4 and 5 layers" in n for n in cut.notes)


def test_hugging_face_llama_whose_first_layer_depends_on_depth() -> None:
    # Its first layer's backward frees, under recomputation, bytes every layer's forward left behind:
    # a cost that grows with depth, extrapolated (and checked against the 5-layer cut), not copied.
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=DEPTH,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = "sdpa"
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))

    def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(input_ids=batch, labels=batch).loss

    cut, stepped = _both(
        lambda: transformers.LlamaForCausalLM(cfg), ids, loss_fn=loss, modes=["none", "selective", "full"]
    )
    _same(cut, stepped)
    first, second = stepped.layers[0], stepped.layers[1]
    assert first.bwd["full"].delta != second.bwd["full"].delta  # the case the affine ends are for
    assert any("cuts of 3, 4 and 5 layers" in n for n in cut.notes)


class _EveryFourth(nn.Module):
    """Identical blocks, but every fourth one's output is doubled in between: the 5-layer cut shows it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = torch.tanh(block(x))
            if i % 4 == 3:
                x = torch.cat([x, x], dim=0)[: x.shape[0]] * 2
        return x

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).square().mean()


def test_a_stack_the_cuts_cannot_describe_is_stepped_in_full() -> None:
    cut, stepped = _both(_EveryFourth, torch.ones(8, 16), modes=["none", "full"])
    _same(cut, stepped)
    note = next(n for n in cut.notes if n.startswith("meta: every layer stepped"))
    assert "5-layer run differs from what the 3- and 4-layer runs predict" in note


class _IndexedByDepth(nn.Module):
    """A forward that walks the stack by a depth fixed at construction: a cut stack cannot run."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = DEPTH
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(DEPTH))

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.depth):
            x = torch.tanh(self.blocks[i](x))
        return x.square().mean()


def test_a_model_that_cannot_run_cut_is_stepped_in_full() -> None:
    cut, stepped = _both(_IndexedByDepth, torch.ones(8, 16), modes=["none", "full"])
    _same(cut, stepped)
    note = next(n for n in cut.notes if n.startswith("meta: every layer stepped"))
    assert "does not run with its stack cut to 3 layers (IndexError" in note


def test_layers_of_different_shapes_are_stepped_in_full() -> None:
    widths = [32, 64] * (DEPTH // 2) + [32]

    def factory() -> ReferenceGPT:
        return ReferenceGPT(vocab_size=64, seq_len=32, n_layer=DEPTH, n_embd=32, n_head=4, widths=widths)

    prof = profile_meta(factory, _tokens(64, 32), modes=["none", "full"])
    assert len(prof.layers) == DEPTH
    assert any("differ in class or in parameter or buffer shapes" in n for n in prof.notes)
