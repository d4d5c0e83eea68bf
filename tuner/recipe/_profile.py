"""The profile of a recipe's model on one batch of its data: measured here, or on the meta device. On an
accelerator the session calls it through a trial worker (`tuner._trials.runner.profile_recipe`), so that no CUDA
context in the tuning process holds memory every trial then lacks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_recompute.errors import RecomputeError
from lightning_recompute.planner.sharding import ParamLayout
from lightning_recompute.profile.measure import profile_model
from lightning_recompute.profile.meta import profile_meta
from lightning_recompute.profile.model import Profile

if TYPE_CHECKING:
    from tuner.recipe import Recipe

PRECISION_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}
"""Trainer precisions that keep the parameters in another dtype than float32."""


def _first_batch(recipe: Recipe, micro_batch: int | None) -> Any:
    from tuner.recipe import build_datamodule

    data = build_datamodule(recipe, micro_batch)
    data.prepare_data()
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def _model(recipe: Recipe) -> nn.Module:
    """The recipe's model in its trainer precision's parameter dtype."""
    from tuner.recipe import build_model

    model = build_model(recipe)
    dtype = PRECISION_DTYPES.get(recipe.trainer.precision)
    return model.to(dtype=dtype) if dtype is not None else model


def profile_recipe_here(recipe: Recipe, micro_batch: int | None, repeats: int) -> Profile:
    """Measure ``recipe``'s model on its device (CUDA when the recipe asks for it and there is one)."""
    torch.manual_seed(recipe.search.seed)
    model = _model(recipe)
    batch = _first_batch(recipe, micro_batch)
    cuda = recipe.trainer.accelerator in ("cuda", "auto") and torch.cuda.is_available()
    model = model.to("cuda" if cuda else "cpu")
    # Time the profile under the trials' conditions: a recipe may pin trial threads (trial.env OMP_NUM_THREADS).
    threads, previous = str(recipe.trial.env.get("OMP_NUM_THREADS", "")), torch.get_num_threads()
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    try:
        return profile_model(model, batch, recipe.layers, modes=list(recipe.search.modes), repeats=repeats)
    finally:
        torch.set_num_threads(previous)


def profile_recipe_meta(recipe: Recipe, micro_batch: int | None, hardware: str) -> Profile:
    """Profile ``recipe``'s model on the meta device, time estimated for ``hardware`` (a `HARDWARE` key)."""
    batch = _first_batch(recipe, micro_batch)
    # The model is built under torch.device("meta") by profile_meta: parameters cost nothing.
    return profile_meta(
        lambda: _model(recipe), batch, recipe.layers, modes=list(recipe.search.modes), hardware=hardware
    )


def recipe_layout(recipe: Recipe, layer_names: list[str]) -> ParamLayout:
    """Which parameters each layer holds, from the recipe's model built on the meta device (free at any size)."""
    try:
        with torch.device("meta"):
            model = _model(recipe)
    except Exception as err:  # the user's model: whatever its constructor raises on meta
        raise RecomputeError(
            f"model: {recipe.model.class_path} cannot be built on the meta device to read its parameter "
            f"shapes for sharded planning: {type(err).__name__}: {err}"
        ) from err
    return ParamLayout.of_model(model, layer_names)
