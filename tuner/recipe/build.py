"""Instantiating what a recipe names: its LightningModule and its LightningDataModule."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tuner.recipe.checks import _accepts, _init_signature
from tuner.recipe.schema import Recipe, RecipeError

if TYPE_CHECKING:
    import lightning as L


def build_model(recipe: Recipe) -> L.LightningModule:
    """A fresh instance of the recipe's LightningModule."""
    return recipe.model.instantiate()


def build_datamodule(recipe: Recipe, micro_batch: int | None = None) -> L.LightningDataModule:
    """A fresh instance of the recipe's LightningDataModule; ``micro_batch`` overrides its ``batch_size``.

    Raises:
        RecipeError: ``micro_batch`` is given and the data module takes no ``batch_size`` argument.
    """
    if micro_batch is None:
        return recipe.data.instantiate()
    if not _accepts(recipe.data.import_class(), "batch_size"):
        raise RecipeError(
            [
                f"data.class_path: {recipe.data.class_path} takes no batch_size argument, "
                "so micro-batch sizes cannot be tuned"
            ],
            recipe.source,
        )
    return recipe.data.instantiate(batch_size=micro_batch)


def data_batch_size(recipe: Recipe) -> int | None:
    """The batch size the recipe's data module uses when the tuner does not override it.

    Read from ``data.init_args.batch_size``, else the constructor's default; ``None`` when the data
    module has no ``batch_size`` argument with an integer value. Nothing is instantiated: this is
    the batch a training job with the recipe's data runs at, which the tuned micro-batch replaces.
    """
    given = recipe.data.init_args.get("batch_size")
    if given is None:
        try:
            param = _init_signature(recipe.data.import_class()).parameters.get("batch_size")
        except (TypeError, ValueError, RecipeError):
            return None
        given = None if param is None else param.default
    return given if isinstance(given, int) and not isinstance(given, bool) and given > 0 else None
