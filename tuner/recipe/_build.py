"""Instantiating what a recipe names: its LightningModule and its LightningDataModule."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_recompute.errors import clip
from tuner.recipe._schema import Component, Recipe, RecipeError, positive_arg

if TYPE_CHECKING:
    import lightning as L


def build_model(recipe: Recipe) -> L.LightningModule:
    """A fresh instance of the recipe's LightningModule."""
    return _instantiate(recipe, "model")


def build_datamodule(recipe: Recipe, micro_batch: int | None = None) -> L.LightningDataModule:
    """A fresh instance of the recipe's LightningDataModule; ``micro_batch`` overrides its ``batch_size``."""
    return _instantiate(recipe, "data", **({} if micro_batch is None else {"batch_size": micro_batch}))


def _instantiate(recipe: Recipe, key: str, **overrides: Any) -> Any:
    """The component's instance; its constructor refusing the arguments is a `RecipeError` (running out of
    memory is not the recipe's fault: it propagates, for the trial to classify)."""
    import torch

    component: Component = getattr(recipe, key)
    try:
        return component.instantiate(**overrides)
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as err:
        why = f"{component.class_path} refused them: {type(err).__name__}: {clip(str(err))}"
        raise RecipeError([f"{key}.init_args: {why}"], recipe.source) from err


def data_batch_size(recipe: Recipe) -> int | None:
    """The batch size the recipe's data module runs at untuned, without instantiating it (``None``: unknown)."""
    return positive_arg(recipe.data, "batch_size")
