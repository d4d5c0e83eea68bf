"""Save-list families (``selective:<family>``): numerics, what each recomputes, the policy file."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_recompute import PolicyError, RecomputePolicy, apply_policy
from lightning_recompute.reference import Block, ReferenceGPT
from lightning_recompute.selective import SAVE_FAMILIES, resolve_save_ops

B, T, C, H = 2, 8, 16, 4
FAMILIES = [f"selective:{f}" for f in SAVE_FAMILIES]


def _tiny(attention: str) -> ReferenceGPT:
    torch.manual_seed(0)
    return ReferenceGPT(vocab_size=32, seq_len=T, n_layer=3, n_embd=C, n_head=H, dropout=0.2, attention=attention)


def _train_two_steps(model: ReferenceGPT) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 32, (B, T), generator=g), torch.randint(0, 32, (B, T), generator=g)) for _ in range(2)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    torch.manual_seed(1234)  # the dropout stream: identical for every policy
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = model.loss(batch)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, [p.grad.detach().clone() for p in model.parameters()] + [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_bitwise_equal_to_no_recompute_with_dropout(attention: str, family: str) -> None:
    base = _tiny(attention)
    ref_losses, ref_tensors = _train_two_steps(copy.deepcopy(base))
    model = copy.deepcopy(base)
    # The family on two layers, another mode between them: families mix per layer.
    apply_policy(model, RecomputePolicy.from_modes({"blocks.0": family, "blocks.1": "selective", "blocks.2": family}))
    losses, tensors = _train_two_steps(model)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    for a, b in zip(tensors, ref_tensors, strict=True):
        assert torch.equal(a, b)


def _recomputed_flops(mode: str) -> int:
    """Backward FLOPs of a two-block eager stack with block 0 in ``mode``, minus those without recomputation."""

    def run(m: str) -> int:
        torch.manual_seed(0)
        stack = nn.Sequential(Block(C, H, 0.0, "eager", 4, C), Block(C, H, 0.0, "eager", 4, C))
        apply_policy(stack, RecomputePolicy.from_modes({"0": m}))
        x = torch.randn(B, T, C, requires_grad=True)
        with FlopCounterMode(display=False) as counter:
            stack(x).sum().backward()
        return counter.get_total_flops()

    return run(mode) - run("none")


def test_flops_show_which_matmuls_each_family_recomputes() -> None:
    """Exact counts: a family recomputes the GEMMs it does not save (eager attention: the bmms always).

    Block GEMMs: qkv (C -> 3C, wide), proj (C -> C, narrow), fc (C -> 4C, wide), fc_out (4C -> C,
    narrow). fc_out is never recomputed: non-reentrant checkpoint stops once every tensor backward
    needs is back, and nothing needs fc_out's output.
    """
    n = B * T
    qkv, proj, fc = 2 * n * C * 3 * C, 2 * n * C * C, 2 * n * C * 4 * C
    bmm = 2 * (2 * B * H * T * T * (C // H))
    assert _recomputed_flops("selective:attn") == qkv + proj + fc + bmm  # as much as full
    assert _recomputed_flops("selective:attn+wide") == proj + bmm
    assert _recomputed_flops("selective:attn+narrow") == qkv + fc + bmm
    assert _recomputed_flops("selective") == bmm


def test_family_policy_file_round_trip_and_choices(tmp_path: Path) -> None:
    policy = RecomputePolicy.from_modes({"blocks.0": "selective:attn", "blocks.1": "full", "blocks.2": "selective"})
    assert policy.to_dict()["layers"] == {"blocks.0": "selective:attn", "blocks.1": "full", "blocks.2": "selective"}
    path = policy.save(tmp_path / "p.yaml")
    assert "blocks.0: selective:attn" in path.read_text()
    loaded = RecomputePolicy.load(path)
    assert loaded == policy and loaded.fingerprint() == policy.fingerprint()
    assert RecomputePolicy.load(policy.save(tmp_path / "p.json")) == policy
    names = ["blocks.0", "blocks.1", "blocks.2"]
    assert loaded.short(names) == "aFs"
    assert loaded.resolve_choices(names) == {"blocks.0": "selective:attn", "blocks.1": "full", "blocks.2": "selective"}
    assert loaded.family_for("blocks.0") == "attn" and loaded.family_for("blocks.2") is None
    # Another family is another policy.
    other = RecomputePolicy.from_modes({"blocks.0": "selective:attn+wide", "blocks.1": "full", "blocks.2": "selective"})
    assert other != policy and other.fingerprint() != policy.fingerprint()


def test_files_without_families_keep_their_fingerprint() -> None:
    """The fingerprint of content written before families and `compile` existed is unchanged."""
    data = {"version": 1, "layers": {"blocks.0": "none", "blocks.*": "selective"}, "selective": {"save": ["aten.mm"]}}
    policy = RecomputePolicy.from_dict(data)
    expected = hashlib.sha256(json.dumps(data, separators=(",", ":")).encode()).hexdigest()[:16]
    assert policy.fingerprint() == expected == "f00973c68302e2cc"  # as main computed it before families existed
    assert policy.families == ()


@pytest.mark.parametrize(
    ("layers", "words"),
    [
        ({"blocks.0": "selective:nope"}, ["layers.blocks.0", "unknown save-list family 'nope'", "attn+wide"]),
        ({"blocks.0": "full:attn"}, ["layers.blocks.0", "only selective takes a save-list family"]),
        ({"blocks.0": "selective:"}, ["layers.blocks.0", "selective:<family>"]),
        ({"blocks.0": "sideways:attn"}, ["layers.blocks.0", "unknown mode", "valid modes are"]),
    ],
)
def test_bad_family_modes_name_file_key_and_valid_choices(layers: dict[str, str], words: list[str]) -> None:
    with pytest.raises(PolicyError) as err:
        RecomputePolicy.from_dict({"version": 1, "layers": layers}, source="p.yaml")
    message = str(err.value)
    assert message.startswith("p.yaml: ")
    for word in words:
        assert word in message, message


def test_matmul_qualifiers_in_save_lists() -> None:
    ops = resolve_save_ops(["aten.addmm:wide"])
    assert (torch.ops.aten.addmm.default, "wide") in ops and torch.ops.aten.addmm.default not in ops
    RecomputePolicy.uniform("selective", selective_save=("aten.mm:narrow",))  # a valid global save list
    with pytest.raises(PolicyError, match=r"selective.save: save-list entry 'aten.bmm:wide'.*aten.mm or aten.addmm"):
        RecomputePolicy.uniform("selective", selective_save=("aten.bmm:wide",))
    with pytest.raises(PolicyError, match="one of wide, narrow"):
        resolve_save_ops(["aten.mm:tall"])
