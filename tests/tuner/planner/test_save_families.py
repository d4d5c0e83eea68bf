"""Save-list families in the tuner: profiled per layer, chosen per layer by the planner, in the search space."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from lightning_recompute import step_peak
from lightning_recompute.planner import Planner
from lightning_recompute.profile import Profile, profile_model
from lightning_recompute.profile.model import FAMILY_MODES
from lightning_recompute.reference import ReferenceGPT
from tuner._search.space import LayerInfo, SearchSpace

B, T = 2, 32
MODES = ["none", "selective", *FAMILY_MODES, "full"]


def _model() -> ReferenceGPT:
    torch.manual_seed(0)
    # sdpa without dropout: the fused attention kernel is what every family keeps.
    return ReferenceGPT(vocab_size=64, seq_len=T, n_layer=3, n_embd=32, n_head=4, dropout=0.0, attention="sdpa")


@pytest.fixture(scope="module")
def measured() -> tuple[ReferenceGPT, tuple[torch.Tensor, torch.Tensor], Profile]:
    model = _model()
    x = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1))
    batch = (x, x.roll(-1, 1))
    prof = profile_model(model, batch, modes=MODES, repeats=1, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    return model, batch, prof


@pytest.mark.slow
def test_the_profile_costs_each_family_per_layer_in_the_order_its_save_list_implies(measured: Any) -> None:
    _, _, prof = measured
    assert prof.modes == MODES
    for layer in prof.layers:
        kept = {m: layer.kept_bytes(m) for m in MODES}
        # Saving a superset of ops keeps at least as many bytes; full keeps only the input.
        assert kept["full"] <= kept["selective:attn"] <= kept["selective:attn+wide"] <= kept["selective"]
        assert kept["selective:attn"] <= kept["selective:attn+narrow"] <= kept["selective"] <= kept["none"]
        assert kept["selective:attn+wide"] < kept["selective"]  # the families are different choices
        flops = {m: layer.recompute_flops(m) for m in MODES}
        # attn recomputes every GEMM but the last (nothing needs fc_out's output): full minus attention.
        assert flops["selective"] == 0 < flops["selective:attn+wide"] < flops["selective:attn"] <= flops["full"]


@pytest.mark.slow
def test_the_planner_mixes_families_per_layer_and_predicts_their_peak(measured: Any) -> None:
    model, batch, prof = measured
    # In Lightning's order (the previous step's gradients alive through the forward) the forward's
    # activations set the peak of this 3-layer model, which is where the families differ; freed at
    # batch start, the peak moves to the backward and the front has too few points to show them.
    planner = Planner(prof, free_grads_at_batch_start=False)
    # Against `none` only: every family keeps fewer bytes than none, so the low-memory end of this
    # front is made of families whatever the measured times (with selective and full also offered,
    # a tiny model's timing noise can let full dominate them, and the test would test the clock).
    front = planner.pareto_front(["none", *FAMILY_MODES])
    chosen = {m for p in front for m in p.modes.values()}
    assert chosen & set(FAMILY_MODES), f"no family on the Pareto front: {[p.short() for p in front]}"
    # A front point using a family: the prediction holds when measured, as for the other modes.
    pick = next(p for p in front if set(p.modes.values()) & set(FAMILY_MODES))
    measured_peak = step_peak(copy.deepcopy(model), [batch, batch], pick.policy, free_grads_at_batch_start=False)
    assert abs(pick.peak_bytes - measured_peak) <= 0.05 * measured_peak, (pick.short(), pick.peak_bytes, measured_peak)
    # Without the families the planner cannot produce those points.
    assert not {m for p in planner.pareto_front(["none", "selective", "full"]) for m in p.modes.values()} & set(
        FAMILY_MODES
    )


def test_the_search_space_includes_families_and_its_signature_says_so() -> None:
    layers = [LayerInfo(f"blocks.{i}", "k") for i in range(3)]
    base = SearchSpace.for_layers(layers, ["none", "selective", "full"])
    fam = SearchSpace.for_layers(layers, MODES)
    assert fam.signature() != base.signature() and fam.signature()["modes"] == MODES
    assert fam.fill_mode == "none"
    assert "n_selective:attn" in fam.distributions()
    modes = {"blocks.0": "selective:attn", "blocks.1": "selective:attn+wide", "blocks.2": "none"}
    params = fam.nearest(modes)
    assert params is not None
    policy, _ = fam.decode(params)
    assert sorted(policy.resolve_choices(list(modes)).values()) == sorted(modes.values())
    per_layer = SearchSpace(layer_names=tuple(modes), modes=tuple(MODES), grouped=False)
    assert per_layer.decode(per_layer.encode(modes) or {})[0].short(list(modes)) == "aw."
