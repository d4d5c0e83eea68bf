"""Tuning recipes: the YAML file that says what to tune, on what, within which budget.

A recipe names the model and the data the LightningCLI way (``class_path`` + ``init_args``, so a
user points it at their own LightningModule), the trainer settings, the memory budget, how long
to search and measure, and where results go::

    model:
      class_path: lightning_recompute.reference.ReferenceGPT   # the default
      init_args: {n_layer: 4, n_embd: 64, seq_len: 128}
    trainer: {accelerator: cpu, precision: 32-true}
    budget: 20MiB                # or {value: 0.8, margin: 0.05}, "80%", 21474836480
    search: {n_trials: 12, modes: [none, selective, full]}
    trial: {warmup_steps: 1, measure_steps: 3}

`load` validates the whole file before anything runs and reports *every* problem at once, each
as ``key.path: problem (valid: ...)``: a tuning session that dies on its fifth trial because of a
typo found one at a time is the experience this module exists to prevent. The schema is declared
once, as pydantic dataclasses, so the validator and the JSON Schema (`json_schema`, printed by
``recompute-tune schema`` for editors) cannot drift apart.

Relative paths in a recipe (the output policy, sqlite databases, journal files) resolve against
the recipe's folder, so a recipe means the same thing whatever directory the tuner runs from.

Modules: `tuner.recipe._schema` (the declared schema and `Recipe`), `tuner.recipe._checks` (the
checks pydantic cannot make), `tuner.recipe._load` (reading and validating), `tuner.recipe._build`
(instantiating the model and the data). Importing this package imports neither torch nor Lightning.
"""

from __future__ import annotations

from tuner.recipe._build import build_datamodule, build_model
from tuner.recipe._load import from_dict, json_schema, load
from tuner.recipe._schema import Recipe, RecipeError

__all__ = ["Recipe", "RecipeError", "build_datamodule", "build_model", "from_dict", "json_schema", "load"]
