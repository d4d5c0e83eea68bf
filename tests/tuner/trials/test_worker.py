"""The child side of a trial, run in this process: what it meters is what `step_peak` measures."""

from __future__ import annotations

import pytest

from lightning_recompute import RecomputePolicy, step_peak
from tuner.recipe import build_datamodule, build_model, from_dict
from tuner.trials import worker

RECIPE = {
    "model": {"init_args": {"n_layer": 3, "n_embd": 32, "seq_len": 16, "n_head": 2, "vocab_size": 64}},
    "data": {"init_args": {"batch_size": 4, "num_batches": 4}},
    "budget": "64MiB",
    "search": {"seed": 0},
}


@pytest.mark.parametrize("glyphs", ["none", "full", "mixed"])
def test_a_trials_steady_peak_is_step_peak_of_the_same_recipe_and_policy(glyphs: str) -> None:
    recipe = from_dict(RECIPE)
    policy = {
        "none": RecomputePolicy.uniform("none"),
        "full": RecomputePolicy.uniform("full"),
        "mixed": RecomputePolicy.from_modes({"blocks.0": "full", "blocks.1": "selective"}),
    }[glyphs]
    spec = {"recipe": recipe.to_dict(), "policy": policy.to_dict(), "warmup_steps": 1, "measure_steps": 1}
    steps = worker._trial(spec)["steps"]
    # The trial meters the warm-up step and the one after it (optimizer state allocated): the peak it checks.
    trial_peak = steps[1]["peak_bytes"]
    assert trial_peak == step_peak(build_model(recipe), build_datamodule(recipe), policy, layers=recipe.layers)
