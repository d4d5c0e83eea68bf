"""Tuning recipes: what to tune, on what, within which budget (docs/TUNER.md, Recipes). Importing this package
imports neither torch nor Lightning."""

from __future__ import annotations

from tuner.recipe._build import build_datamodule, build_model
from tuner.recipe._load import from_dict, json_schema, load
from tuner.recipe._schema import Recipe, RecipeError

__all__ = ["Recipe", "RecipeError", "build_datamodule", "build_model", "from_dict", "json_schema", "load"]
