"""apply_policy / remove_policy: numerics, state_dict stability, idempotence, what is recomputed."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_recompute import (
    IncompatibleModelError,
    Mode,
    PolicyError,
    RecomputePolicy,
    applied_policy,
    apply_policy,
    remove_policy,
)
from lightning_recompute.reference import Block, ReferenceGPT

B, T, C, H = 2, 16, 32, 4

MIXED = RecomputePolicy(
    layers=(("blocks.0", Mode.NONE), ("blocks.1", Mode.SELECTIVE), ("blocks.2", Mode.OFFLOAD), ("blocks.*", Mode.FULL))
)
POLICIES = {
    "none": RecomputePolicy.uniform("none"),
    "selective": RecomputePolicy.uniform("selective"),
    "full": RecomputePolicy.uniform("full"),
    "offload": RecomputePolicy.uniform("offload"),
    "mixed": MIXED,
    "selective-bmm-saved": RecomputePolicy.uniform("selective", selective_save=("aten.mm", "aten.addmm", "aten.bmm")),
}


def _tiny(attention: str) -> ReferenceGPT:
    torch.manual_seed(0)
    return ReferenceGPT(vocab_size=64, seq_len=T, n_layer=4, n_embd=C, n_head=H, dropout=0.2, attention=attention)


def _train_two_steps(model: ReferenceGPT) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Two AdamW steps with dropout active; returns the losses and the last gradients."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 64, (B, T), generator=g), torch.randint(0, 64, (B, T), generator=g)) for _ in range(2)]
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
    return losses, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_gradients_bitwise_equal_to_no_recompute(attention: str, policy_name: str) -> None:
    base = _tiny(attention)
    ref_losses, ref_grads = _train_two_steps(copy.deepcopy(base))
    model = copy.deepcopy(base)
    apply_policy(model, POLICIES[policy_name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # offload's "no effect on CPU" notice
        losses, grads = _train_two_steps(model)
    for a, b in zip(losses, ref_losses, strict=True):
        assert torch.equal(a, b)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name
    # and the parameters after two optimizer steps
    ref_model = copy.deepcopy(base)
    _train_two_steps(ref_model)
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_state_dict_keys_and_module_paths_never_change() -> None:
    model = _tiny("eager")
    keys = list(model.state_dict())
    paths = [n for n, _ in model.named_modules()]
    for policy in POLICIES.values():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            apply_policy(model, policy)
        assert list(model.state_dict()) == keys
        assert [n for n, _ in model.named_modules()] == paths
    # a checkpoint saved under one policy loads under another, and into a plain model
    sd = model.state_dict()
    other = _tiny("eager")
    apply_policy(other, RecomputePolicy.uniform("full"))
    other.load_state_dict(sd)
    _tiny("eager").load_state_dict(sd)


def _wrapped(model: nn.Module) -> dict[str, str]:
    return {n: m.__dict__["forward"].mode.value for n, m in model.named_modules() if "forward" in m.__dict__}


def test_apply_twice_equals_once_and_replace_and_remove() -> None:
    model = _tiny("eager")
    apply_policy(model, MIXED)
    once = _wrapped(model)
    apply_policy(model, MIXED)
    assert _wrapped(model) == once
    assert once == {"blocks.1": "selective", "blocks.2": "offload", "blocks.3": "full"}
    # a different policy replaces the old one entirely (blocks.1-2 are no longer wrapped)
    apply_policy(model, RecomputePolicy.from_modes({"blocks.3": "selective"}))
    assert _wrapped(model) == {"blocks.3": "selective"}
    assert applied_policy(model).modes["blocks.0"] is Mode.NONE
    removed = remove_policy(model)
    assert removed == RecomputePolicy.from_modes({"blocks.3": "selective"})
    assert _wrapped(model) == {} and applied_policy(model) is None
    assert remove_policy(model) is None


def test_deepcopy_and_pickle_rebind_to_the_copy() -> None:
    model = _tiny("eager")
    apply_policy(model, RecomputePolicy.uniform("full"))
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        fwd = clone.blocks[0].__dict__["forward"]
        assert fwd.module is clone.blocks[0]
        x = torch.randint(0, 64, (B, T))
        model.eval(), clone.eval()
        assert torch.equal(clone(x), model(x))


def test_refuses_foreign_checkpoint_wrappers() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _tiny("eager")
    model.blocks[1] = checkpoint_wrapper(model.blocks[1])
    with pytest.raises(IncompatibleModelError, match=r"blocks\.1.*CheckpointWrapper"):
        apply_policy(model, RecomputePolicy.uniform("full"))

    hf_style = _tiny("eager")
    hf_style.gradient_checkpointing = True
    with pytest.raises(IncompatibleModelError, match="gradient_checkpointing"):
        apply_policy(hf_style, RecomputePolicy.uniform("full"))


def test_unmatched_pattern_lists_existing_layers() -> None:
    with pytest.raises(
        PolicyError, match=r"\['layers\.\*'\] match no layer.*blocks\.0, blocks\.1, blocks\.2, blocks\.3"
    ):
        apply_policy(_tiny("eager"), RecomputePolicy.uniform("full", pattern="layers.*"))


def test_offload_on_cpu_warns_once_and_changes_nothing() -> None:
    model = _tiny("eager")
    apply_policy(model, RecomputePolicy.uniform("offload"))
    x = torch.randint(0, 64, (B, T))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x).sum().backward()
        model(x).sum().backward()
    msgs = [str(w.message) for w in caught if "offload" in str(w.message)]
    assert len(msgs) == 1 and "no effect on CPU" in msgs[0]


def _block_flops(mode: str) -> int:
    torch.manual_seed(0)
    stack = nn.Sequential(Block(C, H, 0.0, "eager", 4, C), Block(C, H, 0.0, "eager", 4, C))
    apply_policy(stack, RecomputePolicy.from_modes({"0": mode}))
    x = torch.randn(B, T, C, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        stack(x).sum().backward()
    return counter.get_total_flops()


def test_flops_show_exactly_what_is_recomputed() -> None:
    """Counting FLOPs proves the mechanism: full replays the block's forward, selective only the bmms."""
    d = C // H
    # qkv, proj, fc. Not fc_out: non-reentrant checkpoint stops recomputing once every tensor
    # backward needs is back, and fc_out's output is needed by nothing (dropout keeps only its mask).
    linear_fwd = 2 * B * T * (C * 3 * C + C * C + C * 4 * C)
    bmm_fwd = 2 * (2 * B * H * T * T * d)  # q @ k^T and att @ v
    base = _block_flops("none")
    assert _block_flops("full") - base == linear_fwd + bmm_fwd
    assert _block_flops("selective") - base == bmm_fwd


def test_offload_hooks_move_activations_but_never_weights() -> None:
    """The CUDA offload path, exercised on CPU by treating "cpu" as the device to offload from."""
    from lightning_recompute.apply import _OffloadActivations

    torch.manual_seed(0)
    block = Block(C, H, 0.0, "eager", 4, C)
    x = torch.randn(B, T, C, requires_grad=True)
    ref_out = block(x)
    ref_out.sum().backward()
    ref = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()

    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    moved, kept = [], []
    hooks = _OffloadActivations(block, device_type="cpu", pin_memory=False)
    inner_pack = hooks.pack_hook

    def spy(t: torch.Tensor) -> object:
        packed = inner_pack(t)
        (moved if isinstance(packed, tuple) else kept).append(t.untyped_storage().data_ptr())
        return packed

    hooks.pack_hook = spy
    with hooks:
        out = block(x)
    out.sum().backward()
    assert moved and not (set(moved) & weights)  # activations went to "host" copies
    assert weights & set(kept)  # the weights linear layers save stayed where they were
    for n, p in block.named_parameters():
        assert torch.equal(p.grad, ref[n]), n
