"""Tuning recipes: the YAML file that says what to tune, on what, within which budget (docs/TUNER.md, Recipes).

The model and data are named the LightningCLI way (``class_path`` + ``init_args``). `load` validates the whole
file before anything runs and reports every problem at once, each as ``key.path: problem (valid: ...)``. The
schema is declared once, as pydantic dataclasses, so the validator and the JSON Schema (`json_schema`) cannot
drift apart. Relative paths resolve against the recipe's folder. Importing this package imports neither torch
nor Lightning.
"""

from __future__ import annotations

from tuner.recipe._build import build_datamodule, build_model
from tuner.recipe._load import from_dict, json_schema, load
from tuner.recipe._schema import Recipe, RecipeError

__all__ = ["Recipe", "RecipeError", "build_datamodule", "build_model", "from_dict", "json_schema", "load"]
