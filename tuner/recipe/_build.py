"""Instantiating what a recipe names: its LightningModule and its LightningDataModule."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_recompute.errors import clip
from tuner.recipe._schema import Component, Recipe, RecipeError, accepts, init_signature

if TYPE_CHECKING:
    import lightning as L


def build_model(recipe: Recipe) -> L.LightningModule:
    """A fresh instance of the recipe's LightningModule; a `RecipeError` when its constructor refuses the
    recipe's ``model.init_args``."""
    return _instantiate(recipe, "model", recipe.model)


def build_datamodule(recipe: Recipe, micro_batch: int | None = None) -> L.LightningDataModule:
    """A fresh instance of the recipe's LightningDataModule; ``micro_batch`` overrides its ``batch_size`` (a
    `RecipeError` when it takes none)."""
    if micro_batch is None:
        return _instantiate(recipe, "data", recipe.data)
    if not accepts(recipe.data.import_class(), "batch_size"):
        why = f"{recipe.data.class_path} takes no batch_size argument, so micro-batch sizes cannot be tuned"
        raise RecipeError([f"data.class_path: {why}"], recipe.source)
    return _instantiate(recipe, "data", recipe.data, batch_size=micro_batch)


def _instantiate(recipe: Recipe, key: str, component: Component, **overrides: Any) -> Any:
    """``component``'s instance; the user's constructor refusing its arguments is a `RecipeError` (running out of
    memory is not the recipe's fault: it propagates, for the trial to classify)."""
    import torch

    try:
        return component.instantiate(**overrides)
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as err:
        why = f"{component.class_path} refused them: {type(err).__name__}: {clip(str(err))}"
        raise RecipeError([f"{key}.init_args: {why}"], recipe.source) from err


def data_batch_size(recipe: Recipe) -> int | None:
    """The batch size the recipe's data module runs at untuned (``data.init_args.batch_size``, else the
    constructor's default), without instantiating it; ``None`` when it has no positive integer one."""
    given = recipe.data.init_args.get("batch_size")
    if given is None:
        try:
            param = init_signature(recipe.data.import_class()).parameters.get("batch_size")
        except (TypeError, ValueError, RecipeError):
            return None
        given = None if param is None else param.default
    return given if isinstance(given, int) and not isinstance(given, bool) and given > 0 else None
