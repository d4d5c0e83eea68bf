"""The sharded planner (`lightning_recompute.planner.sharding`): FSDP2's per-rank terms on a hand-computed profile,
the padding rule, DDP's buckets, world size 1 as one device, static terms that do not scale with
the micro-batch, reading a recipe's strategy, and the ``plan --world-size/--strategy`` flags.

The real 2-rank FSDP2 run the terms are checked against is `bench/sharded_planner_accuracy.py`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bench.llama_like import LlamaConfig, LlamaLike
from lightning_recompute.planner import Planner, PlannerError
from lightning_recompute.planner.sharding import (
    STRATEGIES,
    ParamGroup,
    ParamLayout,
    Sharding,
    shard_profile,
    sharding_for,
)
from lightning_recompute.profile import LayerProfile, Profile, SegmentCost
from tests.helpers import REPO
from tuner.cli import build_parser, main

# --------------------------------------------------------------------------- a hand-computed profile

# Two layers, each one float32 parameter of shape (4, 2) (32 bytes); the root one of shape (3, 2)
# (24 bytes), which at world size 2 pads to 2 rows a rank (16 bytes; 32 gathered).
LAYOUT = ParamLayout(
    layers=tuple(ParamGroup(f"blocks.{i}", ((4, 2),), (4,), (True,)) for i in range(2)),
    root=ParamGroup("", ((3, 2),), (4,), (True,)),
)


def _profile(act: int = 1) -> Profile:
    """A one-device profile shaped like a real one; ``act=0`` zeroes every activation term."""

    def seg(delta: int, peak: int, grad: int = 0, scales: bool = True) -> SegmentCost:
        return SegmentCost(delta=delta, peak=peak, grad=grad, seconds=1e-3, scales=scales)

    layers = [
        LayerProfile(
            name=f"blocks.{i}",
            group="g",
            param_bytes=32,
            fwd={"none": seg(20 * act, 30 * act), "full": seg(5 * act, 25 * act)},
            bwd={"none": seg(32 - 20 * act, 32 + 8 * act, grad=32), "full": seg(32 - 5 * act, 32 + 18 * act, grad=32)},
            net=32,
        )
        for i in range(2)
    ]
    fixed = {
        "step->fwd_start:0": seg(5 * act, 5 * act),
        "fwd_end:1->output": seg(6 * act, 6 * act),
        "output->loss": seg(act, 10 * act),
        "loss->zero_grad": seg(-88, 0, grad=-88),
        "zero_grad->bwd_start:1": seg(3 * act, 12 * act),
        "bwd_end:0->backward": seg(24 - 11 * act, 24 + 6 * act, grad=24),
        "backward->optimizer": seg(0, 40, scales=False),
    }
    timeline = [
        "fixed:step->fwd_start:0",
        "fwd:0",
        "fwd:1",
        "fixed:fwd_end:1->output",
        "fixed:output->loss",
        "fixed:loss->zero_grad",
        "fixed:zero_grad->bwd_start:1",
        "bwd:1",
        "bwd:0",
        "fixed:bwd_end:0->backward",
        "fixed:backward->optimizer",
    ]
    return Profile(
        layers=layers,
        timeline=timeline,
        fixed=fixed,
        modes=["none", "full"],
        base_bytes=88 + 88 + 176 + 10 * act,  # parameters, gradients, AdamW state, batch
        param_bytes=88,
        grad_bytes=88,
        optimizer_bytes=176,
        batch_bytes=10 * act,
        micro_batch=1,
        device="cpu",
        time_source="measured",
    )


def _uniform(mode: str) -> dict[str, str]:
    return {"blocks.0": mode, "blocks.1": mode}


def test_padding_rule_rounds_dim_zero_up_per_parameter() -> None:
    group = ParamGroup("x", ((5, 3), (7,), ()), (4, 2, 4), (True, False, True))
    # ceil(5/2)=3 rows of 3 floats, ceil(7/2)=4 halves, a scalar is one row.
    assert group.shard_bytes(2) == 3 * 3 * 4 + 4 * 2 + 4
    assert group.gathered_bytes(2) == 2 * group.shard_bytes(2)
    assert group.shard_bytes(2, trainable_only=True) == 3 * 3 * 4 + 4
    assert group.shard_bytes(1) == 15 * 4 + 7 * 2 + 4
    assert group.shard_bytes(64) == 1 * 3 * 4 + 1 * 2 + 4  # more ranks than rows: one padded row each


def test_fsdp_terms_match_the_hand_computed_timeline() -> None:
    sharded = shard_profile(_profile(), LAYOUT, Sharding("fsdp", 2))
    # base: 3 shards of 16 bytes for parameters and for gradients, AdamW state 176 * 48/88, the batch.
    assert (sharded.param_bytes, sharded.grad_bytes, sharded.optimizer_bytes) == (48, 48, 96)
    assert sharded.base_bytes == 48 + 48 + 96 + 10
    planner = Planner(sharded)
    none = planner.predict(_uniform("none"))
    # Walked by hand: the root gathers (+64), layer 1's forward holds its gathered parameters and
    # its all-gather buffer (32 + 32) over its 30-byte transient on a level of 202+5+64+20.
    assert (none.peak_bytes, none.peak_at) == (353, "fwd:1")
    full = planner.predict(_uniform("full"))
    # Layer 0's backward: its gathered parameters (32) over the 50-byte recompute transient, on a
    # level where layer 1's reduce-scatter input (32) is still held and its own buffer (32) freed.
    assert (full.peak_bytes, full.peak_at) == (336, "bwd:0")
    one_device = Planner(_profile()).predict(_uniform("none")).peak_bytes
    assert none.peak_bytes < one_device


def test_model_parallel_is_planned_as_fsdp2() -> None:
    fsdp = Planner(shard_profile(_profile(), LAYOUT, Sharding("fsdp", 2))).predict(_uniform("full"))
    mp = Planner(shard_profile(_profile(), LAYOUT, Sharding("model_parallel", 2))).predict(_uniform("full"))
    assert fsdp.peak_bytes == mp.peak_bytes


def test_static_terms_do_not_scale_with_the_micro_batch() -> None:
    # No activations (nor batch) at all: only parameters, gradients and FSDP's buffers, none of which grows
    # with the batch, so the prediction is the same at any micro-batch.
    planner = Planner(shard_profile(_profile(act=0), LAYOUT, Sharding("fsdp", 2)))
    at_one = planner.predict(_uniform("none"), micro_batch=1)
    at_four = planner.predict(_uniform("none"), micro_batch=4)
    assert at_one.peak_bytes == at_four.peak_bytes


def test_ddp_adds_the_gradient_buckets_to_one_device() -> None:
    one = Planner(_profile()).predict(_uniform("none"))
    ddp = Planner(shard_profile(_profile(), LAYOUT, Sharding("ddp", 8))).predict(_uniform("none"))
    assert ddp.peak_bytes == one.peak_bytes + 88


def test_world_size_one_is_one_device_exactly() -> None:
    prof = _profile()
    assert shard_profile(prof, LAYOUT, Sharding("fsdp", 1)) is prof
    for mode in ("none", "full"):
        assert Planner(shard_profile(prof, LAYOUT, Sharding("fsdp", 1))).predict(_uniform(mode)) == Planner(
            prof
        ).predict(_uniform(mode))


def test_layout_of_a_model_and_a_mismatched_layout() -> None:
    cfg = LlamaConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, ffn_dim=24, max_seq_len=8)
    with torch.device("meta"):
        model = LlamaLike(cfg)
    layout = ParamLayout.of_model(model, ["layers.0", "layers.1"])
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(g.shard_bytes(1) for g in (*layout.layers, layout.root)) == total
    assert layout.root.shapes == ((64, 16), (16,), (64, 16))  # embedding, norm, head
    with pytest.raises(PlannerError, match="layers"):
        ParamLayout.of_model(model, ["layers.7"])
    with pytest.raises(PlannerError, match="differ from the profile"):
        shard_profile(_profile(), layout, Sharding("fsdp", 2))


# --------------------------------------------------------------------------- reading the recipe


def _recipe(**trainer: Any) -> Any:
    return SimpleNamespace(trainer=SimpleNamespace(accelerator="cuda", precision="bf16-true", **trainer))


def test_sharding_for_reads_the_recipe_and_the_flags() -> None:
    assert sharding_for(_recipe(devices=1)) is None
    assert sharding_for(_recipe(devices=1), world_size=64, strategy="fsdp") == Sharding("fsdp", 64)
    assert sharding_for(_recipe(devices=8, num_nodes=4, strategy="ddp")) == Sharding("ddp", 32)
    assert sharding_for(_recipe(devices=8, num_nodes=1, strategy="auto")) == Sharding("ddp", 8)
    assert sharding_for(_recipe(devices=8, strategy="model_parallel"), world_size=64) == Sharding("model_parallel", 64)
    declared = SimpleNamespace(
        class_path="lightning.pytorch.strategies.ModelParallelStrategy",
        init_args={"data_parallel_size": 16, "tensor_parallel_size": 1},
    )
    assert sharding_for(_recipe(devices=8, num_nodes=2, strategy=declared)) == Sharding("model_parallel", 16)


@pytest.mark.parametrize(
    ("trainer", "flags", "message"),
    [
        ({}, {"world_size": 0}, "--world-size: must be a positive integer, got 0"),
        ({}, {"world_size": True}, "--world-size: must be a positive integer"),
        ({"devices": 8}, {"world_size": 60}, "60 is not a multiple of the recipe's trainer.devices 8"),
        ({"strategy": "deepspeed", "devices": 2}, {}, "trainer.strategy: the planner cannot predict 'deepspeed'"),
        ({}, {"world_size": 4, "strategy": "zero3"}, "--strategy: the planner cannot predict 'zero3'; valid: ddp"),
        (
            {"strategy": SimpleNamespace(class_path="my.Strategy", init_args={}), "devices": 2},
            {},
            "cannot predict my.Strategy",
        ),
        (
            {"strategy": SimpleNamespace(class_path="ModelParallelStrategy", init_args={"tensor_parallel_size": 2})},
            {"world_size": 8},
            "tensor_parallel_size 2 is not modelled",
        ),
    ],
)
def test_sharding_for_errors_name_the_key_and_the_valid_values(
    trainer: dict[str, Any], flags: dict[str, Any], message: str
) -> None:
    with pytest.raises(PlannerError, match=message.replace("(", r"\(").replace(")", r"\)")):
        sharding_for(_recipe(**trainer), **flags)


def test_sharding_rejects_bad_values_directly() -> None:
    with pytest.raises(PlannerError, match="world size: must be a positive integer, got -2"):
        Sharding("fsdp", -2)
    with pytest.raises(PlannerError, match="valid: ddp, fsdp, model_parallel"):
        Sharding("hsdp", 2)


# --------------------------------------------------------------------------- the CLI


def test_cli_strategy_choices_are_the_planners() -> None:
    for name in STRATEGIES:
        assert build_parser().parse_args(["plan", "r.yaml", "--strategy", name]).strategy == name


def test_cli_plan_flag_errors(capsys: pytest.CaptureFixture[str]) -> None:
    recipe = str(REPO / "recipes" / "quickstart.yaml")
    assert main(["plan", recipe, "--meta", "L4", "--world-size", "0"]) == 2
    assert "--world-size: must be a positive integer, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["plan", recipe, "--strategy", "zero3"])
    assert exc.value.code == 2
    assert "invalid choice: 'zero3'" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_plans_per_rank_on_meta(capsys: pytest.CaptureFixture[str]) -> None:
    recipe = str(REPO / "recipes" / "quickstart.yaml")
    code = main(["plan", recipe, "--meta", "L4", "--world-size", "4", "--strategy", "fsdp", "--budget", "1GiB"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "predicted Pareto front, per rank, world size 4, fsdp (" in out
    assert "sharded (rank 0, padded)" in out


def test_llama_70b_recipe_loads() -> None:
    from tuner.recipe import load

    recipe = load(REPO / "recipes" / "llama-70b-fsdp-plan.yaml")
    assert recipe.model.init_args["n_layer"] == 80
