"""``search.compile``: the search space's compile dimension, compiled layers' numerics, and a compiled trial.

The slow tests compile one tiny block graph (width 16, seq 8, batch 2, one block in ``full``);
the trial compiles the same block shapes in its own process.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_recompute import PolicyError, RecomputePolicy, apply_policy, remove_policy
from lightning_recompute.apply import COMPILED_ATOL, COMPILED_RTOL
from lightning_recompute.meter import StorageMeter
from lightning_recompute.reference import Block
from tuner import recipe as R
from tuner._search.space import LayerInfo, SearchSpace
from tuner._trials import run_trial

B, T, C, H = 2, 8, 16, 4

LAYERS = [LayerInfo(f"blocks.{i}", "k") for i in range(3)]


def test_compile_is_a_parameter_only_when_both_choices_are_searched() -> None:
    eager = SearchSpace.for_layers(LAYERS, ["none", "full"])
    both = SearchSpace.for_layers(LAYERS, ["none", "full"], compile_choices=[False, True])
    assert "compile" not in eager.distributions() and "compile" not in eager.signature()
    assert both.distributions()["compile"].choices == (False, True)
    assert both.signature() == {**eager.signature(), "compile": [False, True]}  # a new study, not an old one's
    params = both.encode({"blocks.0": "full", "blocks.1": "none", "blocks.2": "none"}, compile_layers=True)
    assert params is not None and params["compile"] is True
    policy, _ = both.decode(params)
    assert policy.compile and policy.to_dict()["compile"] is True
    names = [layer.name for layer in LAYERS]
    assert both.decode({**params, "compile": False})[0] == RecomputePolicy.from_modes(policy.resolve_choices(names))
    only = SearchSpace.for_layers(LAYERS, ["none", "full"], compile_choices=[True])
    assert only.decode({"n_full": 1, "placement": "first"})[0].compile  # every trial compiles
    assert only.encode({n.name: "full" for n in LAYERS}, compile_layers=False) is None  # outside the space
    assert "compile in [false, true]" in both.describe()


def test_the_planner_seeds_a_compiled_twin_of_its_pick() -> None:
    from tuner._search.planner_seeds import planner_seeds

    class _Pick:
        def __init__(self) -> None:
            self.modes = {"blocks.0": "full", "blocks.1": "none", "blocks.2": "none"}
            self.peak_bytes = 1

    class _Planner:
        def solve(self, budget: int, modes: list[str], micro_batch: int | None) -> Any:
            return _Pick()

        def pareto_front(self, modes: list[str], micro_batch: int | None) -> list[Any]:
            return []

    both = SearchSpace.for_layers(LAYERS, ["none", "full"], compile_choices=[False, True])
    seeds, _ = planner_seeds(_Planner(), both, 10, ["none", "full"])  # type: ignore[arg-type]
    assert [(s.name, s.compile) for s in seeds] == [("planner:budget", None), ("planner:budget+compile", True)]
    eager = SearchSpace.for_layers(LAYERS, ["none", "full"])
    assert [s.name for s in planner_seeds(_Planner(), eager, 10, ["none", "full"])[0]] == ["planner:budget"]  # type: ignore[arg-type]


def test_policy_file_compile_key() -> None:
    policy = RecomputePolicy.from_dict({"version": 1, "layers": {"*": "full"}, "compile": True})
    assert policy.compile and policy != RecomputePolicy.uniform("full")
    assert policy.fingerprint() != RecomputePolicy.uniform("full").fingerprint()
    off = RecomputePolicy.from_dict({"version": 1, "layers": {"*": "full"}, "compile": False})
    assert off == RecomputePolicy.uniform("full") and "compile" not in off.to_dict()
    with pytest.raises(PolicyError, match=r"p.yaml: key 'compile' must be true or false, got 'yes'"):
        RecomputePolicy.from_dict({"version": 1, "layers": {"*": "full"}, "compile": "yes"}, source="p.yaml")


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _step(stack: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    stack.zero_grad(set_to_none=True)
    stack(x).sum().backward()
    return {n: p.grad.detach().clone() for n, p in stack.named_parameters() if p.grad is not None}


def _peak(stack: nn.Module, x: torch.Tensor) -> int:
    meter = StorageMeter(torch.device("cpu"))
    with meter:
        stack(x).sum().backward()
    stack.zero_grad(set_to_none=True)
    return meter.peak_bytes


@pytest.fixture(scope="module")
def compiled_block() -> dict[str, Any]:
    torch.manual_seed(0)
    eager = nn.Sequential(Block(C, H, 0.0, "eager", 4, C)).train()
    x = torch.randn(B, T, C, requires_grad=True)
    reference = _step(copy.deepcopy(eager), x)  # eager, no recompute
    full = copy.deepcopy(eager)
    apply_policy(full, RecomputePolicy.uniform("full"), layers=["0"])
    eager_full_peak = _peak(full, x)
    stack = copy.deepcopy(eager)
    keys = list(stack.state_dict())
    apply_policy(stack, RecomputePolicy.uniform("full", compile=True), layers=["0"])
    before = _graphs()
    metered_peak = _peak(stack, x)  # under the ledger's dispatch mode
    graphs_under_meter = _graphs() - before
    grads = _step(stack, x)  # compiles here
    return {
        "reference": reference,
        "grads": grads,
        "eager_full_peak": eager_full_peak,
        "metered_peak": metered_peak,
        "graphs_under_meter": graphs_under_meter,
        "graphs": _graphs() - before,
        "stack": stack,
        "keys": keys,
    }


@pytest.mark.slow
def test_compiled_layers_grads_within_the_stated_tolerance(compiled_block: dict[str, Any]) -> None:
    ref, got = compiled_block["reference"], compiled_block["grads"]
    assert compiled_block["graphs"] == 1  # the block did compile (one graph; not a silent eager run)
    assert got.keys() == ref.keys()
    worst = max(float((got[n] - ref[n]).abs().max()) for n in ref)
    print(f"compiled full vs eager none: max abs grad diff {worst:.3g}")
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=COMPILED_RTOL, atol=COMPILED_ATOL, msg=name)


@pytest.mark.slow
def test_the_cpu_ledger_sees_the_eager_run_and_paths_do_not_change(compiled_block: dict[str, Any]) -> None:
    """What a CPU trial of a compiling policy meters: dynamo runs the layers eagerly under the ledger."""
    assert compiled_block["graphs_under_meter"] == 0
    assert compiled_block["metered_peak"] == compiled_block["eager_full_peak"]
    stack = compiled_block["stack"]
    assert list(stack.state_dict()) == compiled_block["keys"]
    assert stack[0]._compiled_call_impl is not None
    remove_policy(stack)
    assert stack[0]._compiled_call_impl is None


@pytest.mark.slow
def test_a_compiling_trial_reports_compile_time_outside_its_timed_steps(tmp_path: Path) -> None:
    recipe = R.from_dict(
        {
            "budget": "1GiB",
            "model": {"init_args": {"n_layer": 2, "n_embd": C, "n_head": H, "seq_len": T, "dropout": 0.0}},
            "data": {"init_args": {"batch_size": B, "num_batches": 4}},
            "trial": {"warmup_steps": 1, "measure_steps": 2, "timeout_s": 600, "env": {"OMP_NUM_THREADS": 1}},
        },
        source=tmp_path / "recipe.yaml",
    )
    compiled = run_trial(recipe, RecomputePolicy.uniform("full", compile=True))
    eager = run_trial(recipe, RecomputePolicy.uniform("full"))
    assert compiled.outcome == "ok", compiled.error
    assert compiled.compile_s is not None and compiled.compile_s > 0
    assert eager.compile_s is None
    assert len(compiled.step_times_s) == 2  # the compiling step is not among the timed ones
    assert compiled.peak_bytes == eager.peak_bytes  # metered steps run the layers eagerly on CPU


def test_the_recipe_takes_search_compile_and_family_modes() -> None:
    base = {"budget": "1GiB", "search": {"modes": ["none", "full"]}}
    plain = R.from_dict(base)
    assert plain.search.compile == (False,)
    searched = R.from_dict(
        {**base, "search": {"modes": ["none", "selective:attn+wide", "full"], "compile": [False, True]}}
    )
    assert searched.search.compile == (False, True) and "selective:attn+wide" in searched.search.modes
    # The default keeps a recipe's fingerprint (and so its study) as before the key existed.
    assert R.from_dict({**base, "search": {"modes": ["none", "full"], "compile": [False]}}).fingerprint() == (
        plain.fingerprint()
    )
    assert R.from_dict({**base, "search": {"modes": ["none", "full"], "compile": [False, True]}}).fingerprint() != (
        plain.fingerprint()
    )
    with pytest.raises(R.RecipeError, match=r"search.compile"):
        R.from_dict({**base, "search": {"compile": ["sometimes"]}})
    with pytest.raises(R.RecipeError, match=r"search.modes\[1\]"):
        R.from_dict({**base, "search": {"modes": ["none", "selective:mlp"]}})
