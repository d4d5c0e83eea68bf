"""Recipes: defaults, every kind of error (all reported at once), budgets, paths, schema, the shipped recipes."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml

from lightning_recompute import RecomputePolicy
from lightning_recompute.errors import RecomputeError
from lightning_recompute.reference import ReferenceGPT, SyntheticTokens
from tests.helpers import REPO
from tuner import recipe as R
from tuner.recipe import _schema as S


class NeedsWidth(L.LightningModule):
    """A module with a required init argument, for the missing-argument error."""

    def __init__(self, width: int, depth: int = 2) -> None:
        super().__init__()


def _write(folder: Path, data: dict[str, Any] | str, name: str = "recipe.yaml") -> Path:
    path = folder / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data), encoding="utf-8")
    return path


def _errors(data: dict[str, Any]) -> list[str]:
    with pytest.raises(R.RecipeError) as info:
        R.from_dict(data)
    return info.value.errors


# ---------------------------------------------------------------------------------------------- defaults


def test_defaults_fill_everything_and_resolve_against_the_recipe_folder(tmp_path: Path) -> None:
    recipe = R.load(_write(tmp_path, {"budget": "1GiB"}, "small.yaml"))
    assert recipe.source == tmp_path / "small.yaml"
    assert recipe.name == "small"
    assert recipe.model == S.Component(S.REFERENCE_MODEL, {})
    # Synthetic tokens follow the reference model's vocabulary and context when not told otherwise.
    assert recipe.data == S.Component(S.REFERENCE_DATA, {"vocab_size": 256, "seq_len": 64})
    assert recipe.trainer == S.TrainerSettings("cpu", 1, "32-true")
    assert recipe.layers == "auto"
    assert recipe.budget == S.Budget(1 << 30, 0.05)
    assert recipe.search.modes == ("none", "selective", "full")
    assert (recipe.search.n_trials, recipe.search.timeout_s, recipe.search.micro_batch_sizes, recipe.search.seed) == (
        20,
        None,
        None,
        0,
    )
    assert (recipe.trial.warmup_steps, recipe.trial.measure_steps, recipe.trial.timeout_s) == (2, 5, 300.0)
    assert recipe.trial.env == {}
    assert recipe.tracking == S.TrackingSettings(f"sqlite:///{tmp_path}/mlflow.db", "small")
    assert recipe.study == S.StudySettings(f"sqlite:///{tmp_path}/optuna.db", None)
    assert recipe.output == tmp_path / "policy.yaml"


def test_relative_paths_resolve_against_the_recipe_folder_not_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "recipes"
    folder.mkdir()
    path = _write(
        folder,
        {
            "budget": 1000000,
            "output": "out/policy.yaml",
            "tracking": {"uri": "sqlite:///runs/mlflow.db", "experiment": "exp"},
            "study": {"storage": "journal/optuna.log", "name": "s"},
        },
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    recipe = R.load(path)
    assert recipe.output == folder / "out" / "policy.yaml"
    assert recipe.tracking.uri == f"sqlite:///{folder}/runs/mlflow.db"
    assert recipe.study.storage == str(folder / "journal" / "optuna.log")
    # Absolute paths and server URLs are left alone.
    recipe = R.from_dict(
        {
            "budget": 1000000,
            "output": "/abs/p.yaml",
            "tracking": {"uri": "http://mlflow:5000"},
            "study": {"storage": "postgresql://u@db/optuna"},
        },
        source=path,
    )
    assert (recipe.output, recipe.tracking.uri, recipe.study.storage) == (
        Path("/abs/p.yaml"),
        "http://mlflow:5000",
        "postgresql://u@db/optuna",
    )


def test_round_trip_and_fingerprint(tmp_path: Path) -> None:
    recipe = R.load(
        _write(
            tmp_path,
            {"budget": "2GiB", "model": {"init_args": {"n_layer": 3}}, "trial": {"env": {"OMP_NUM_THREADS": 1}}},
        )
    )
    assert recipe.trial.env == {"OMP_NUM_THREADS": "1"}
    again = R.from_dict(recipe.to_dict(), source=recipe.source)
    assert again == recipe
    assert json.loads(json.dumps(recipe.to_dict())) == recipe.to_dict()
    assert again.fingerprint() == recipe.fingerprint()
    more_trials = R.from_dict({**recipe.to_dict(), "search": {"n_trials": 99}}, source=recipe.source)
    assert more_trials.fingerprint() == recipe.fingerprint()  # extending a study keeps its identity
    other_model = R.from_dict({**recipe.to_dict(), "model": {"init_args": {"n_layer": 4}}}, source=recipe.source)
    assert other_model.fingerprint() != recipe.fingerprint()


# ---------------------------------------------------------------------------------------------- budgets


@pytest.mark.parametrize(
    ("value", "stored"),
    [
        ("20GiB", 20 * 1024**3),
        ("20 GiB", 20 * 1024**3),
        ("1.5GiB", int(1.5 * 1024**3)),
        ("20GB", 20 * 1000**3),
        ("512MiB", 512 * 1024**2),
        (21474836480, 21474836480),
        (0.8, 0.8),
        ("80%", 0.8),
        (1.0, 1.0),
    ],
)
def test_budget_values(value: Any, stored: float) -> None:
    recipe = R.from_dict({"budget": value, "trainer": {"accelerator": "cuda"}})
    assert recipe.budget.value == stored
    assert type(recipe.budget.value) is type(stored)  # int bytes vs float fraction
    assert (
        R.from_dict({"budget": {"value": value, "margin": 0.1}, "trainer": {"accelerator": "cuda"}}).budget.value
        == stored
    )


def test_budget_limit_applies_the_margin() -> None:
    absolute = S.Budget(value=1000, margin=0.1)
    assert absolute.limit_bytes(None) == 900
    assert absolute.limit_bytes(10**12) == 900  # the device size does not matter for bytes
    fraction = S.Budget(value=0.8, margin=0.05)
    assert fraction.limit_bytes(80 * 1024**3) == int(0.8 * 80 * 1024**3 * 0.95)
    with pytest.raises(RecomputeError, match="fraction of device memory"):
        fraction.limit_bytes(None)
    assert "GiB" in fraction.describe(80 * 1024**3)


@pytest.mark.parametrize("bad", ["lots", "20 parsecs", "-5GiB", 0, -1, 1.5, "120%", "0%", True])
def test_bad_budgets_name_the_key_and_the_valid_forms(bad: Any) -> None:
    errors = _errors({"budget": bad, "trainer": {"accelerator": "cuda"}})
    assert len(errors) == 1
    assert errors[0].startswith("budget")


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({}, ["budget: missing (required"]),
        ({"budget": "1GiB", "serch": {}}, ["serch: unknown key; did you mean 'search'?", "valid: budget, name, model"]),
        ({"budget": "1GiB", "trial": {"warmup": 1}}, ["trial.warmup: unknown key; did you mean 'warmup_steps'?"]),
        (
            {"budget": "1GiB", "trainer": {"accelerator": "gpu"}},
            ["trainer.accelerator: 'gpu' is not valid", "(valid: cpu, cuda, auto)"],
        ),
        (
            {"budget": "1GiB", "trainer": {"precision": "bf61-mixed"}},
            ["trainer.precision:", "did you mean 'bf16-mixed'?"],
        ),
        (
            {"budget": "1GiB", "trainer": {"devices": 0}},
            ["trainer.devices: input should be greater than or equal to 1"],
        ),
        ({"budget": "1GiB", "trainer": {"num_nodes": "2"}}, ["trainer.num_nodes: input should be a valid integer"]),
        (
            {"budget": "1GiB", "trainer": {"strategy": "dpp"}},
            [
                "trainer.strategy: 'dpp' is not valid; did you mean 'ddp'?",
                "(valid: auto, ddp, fsdp, model_parallel, or",
            ],
        ),
        (
            {"budget": "1GiB", "trainer": {"devices": 2, "strategy": "fsdp"}},
            ["trainer.strategy: 'fsdp' is Lightning's FSDPStrategy (FSDP1), which needs CUDA", "model_parallel"],
        ),
        (
            {"budget": "1GiB", "trainer": {"devices": 2, "strategy": "model_parallel"}},
            [
                "trainer.strategy: 'model_parallel' shards the model in its configure_model hook",
                "ReferenceGPT does not",
            ],
        ),
        (
            {"budget": "1GiB", "trainer": {"strategy": {"class_path": "lightning.pytorch.strategies.DDPStrategie"}}},
            ["trainer.strategy.class_path:", "did you mean 'DDPStrategy'?"],
        ),
        (
            {"budget": "1GiB", "trainer": {"strategy": {"class_path": "collections.OrderedDict"}}},
            ["trainer.strategy.class_path: collections.OrderedDict is not a lightning.pytorch.strategies.Strategy"],
        ),
        (
            {
                "budget": "1GiB",
                "trainer": {
                    "strategy": {
                        "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                        "init_args": {"data_paralel_size": 2},
                    }
                },
            },
            ["trainer.strategy.init_args.data_paralel_size:", "did you mean 'data_parallel_size'?"],
        ),
        (
            {"budget": "1GiB", "search": {"modes": ["none", "ful"]}},
            ["search.modes[1]: 'ful' is not valid; did you mean 'full'?"],
        ),
        ({"budget": "1GiB", "search": {"modes": []}}, ["search.modes:"]),
        ({"budget": "1GiB", "search": {"n_trials": "ten"}}, ["search.n_trials: input should be a valid integer"]),
        ({"budget": "1GiB", "search": {"n_trials": True}}, ["search.n_trials:"]),
        (
            {"budget": "1GiB", "search": {"micro_batch_sizes": [4, 0]}},
            ["search.micro_batch_sizes[1]:", "greater than or equal to 1"],
        ),
        ({"budget": "1GiB", "trial": {"timeout_s": -1}}, ["trial.timeout_s: input should be greater than 0"]),
        ({"budget": "1GiB", "layers": []}, ["layers:"]),
        ({"budget": 0.8}, ["budget.value: 0.8 is a fraction of device memory, but trainer.accelerator is cpu"]),
        ({"budget": "1GiB", "search": {"modes": ["none", "offload"]}}, ["search.modes: 'offload' does nothing on cpu"]),
        (
            {"budget": "1GiB", "study": {"storage": "optuna.db"}},
            ["study.storage: 'optuna.db' is neither a database URL nor a journal file"],
        ),
        (
            {"budget": "1GiB", "model": {"class_path": "no_such_package.Model"}},
            ["model.class_path: cannot import module 'no_such_package'"],
        ),
        (
            {"budget": "1GiB", "model": {"class_path": "lightning_recompute.reference.ReferenceGTP"}},
            ["model.class_path:", "did you mean 'ReferenceGPT'?"],
        ),
        (
            {"budget": "1GiB", "model": {"class_path": "collections.OrderedDict"}},
            ["model.class_path: collections.OrderedDict is not a lightning.LightningModule subclass"],
        ),
        ({"budget": "1GiB", "model": {"class_path": "NoDots"}}, ["model.class_path: 'NoDots' is not a dotted path"]),
        (
            {"budget": "1GiB", "model": {"init_args": {"n_layers": 2}}},
            [
                "model.init_args.n_layers: ReferenceGPT takes no argument 'n_layers'; did you mean 'n_layer'?",
                "valid: vocab_size, seq_len, n_layer",
            ],
        ),
        (
            {"budget": "1GiB", "model": {"class_path": f"{__name__}.NeedsWidth"}},
            ["model.init_args.width: missing; NeedsWidth requires it"],
        ),
        (
            {"budget": "1GiB", "model": {"init_args": "n_layer=2"}},
            ["model.init_args: input should be a valid dictionary"],
        ),
        (
            {"budget": "1GiB", "data": {"class_path": "lightning_recompute.reference.ReferenceGPT"}},
            [
                "data.class_path: lightning_recompute.reference.ReferenceGPT"
                " is not a lightning.LightningDataModule subclass"
            ],
        ),
        (
            {"budget": "1GiB", "data": {"init_args": {"seq_len": 512}}},
            ["data.init_args.seq_len: 512 exceeds the model's seq_len 64"],
        ),
    ],
)
def test_each_kind_of_error_names_its_key_and_the_valid_choices(data: dict[str, Any], expected: list[str]) -> None:
    errors = _errors(data)
    assert len(errors) == 1, errors
    for fragment in expected:
        assert fragment in errors[0], (fragment, errors[0])


def test_five_mistakes_are_reported_together_with_the_file_name(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """\
budget: 20 parsecs
trainer:
  acelerator: cpu
model:
  init_args: {n_layers: 2}
search:
  modes: [none, ful]
data:
  class_path: nope.Module
""",
    )
    with pytest.raises(R.RecipeError) as info:
        R.load(path)
    err = info.value
    assert isinstance(err, RecomputeError)
    assert len(err.errors) == 5, err.errors
    paths = sorted(e.split(":", 1)[0] for e in err.errors)
    assert paths == [
        "budget.value",
        "data.class_path",
        "model.init_args.n_layers",
        "search.modes[1]",
        "trainer.acelerator",
    ]
    text = str(err)
    assert text.startswith(f"{path}: 5 problems:")
    assert all(e in text for e in err.errors)


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(R.RecipeError, match="recipe file not found"):
        R.load(tmp_path / "missing.yaml")
    with pytest.raises(R.RecipeError, match="malformed YAML"):
        R.load(_write(tmp_path, "budget: [1GiB\n"))
    with pytest.raises(R.RecipeError, match="duplicate key 'budget'"):
        R.load(_write(tmp_path, "budget: 1GiB\nbudget: 2GiB\n"))
    with pytest.raises(R.RecipeError, match="must be a mapping"):
        R.load(_write(tmp_path, "- budget\n"))
    with pytest.raises(R.RecipeError, match="budget: missing"):
        R.load(_write(tmp_path, ""))


def _bomb(levels: int) -> str:
    """A YAML "billion laughs": each level lists the previous one ten times (10**levels leaves)."""
    lines = ['a0: &a0 ["lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "NUL bytes"),
        ("budget: 1GiB\n".encode("utf-16"), "UTF-16"),
        (b"budget: \xff\xfe1GiB\n", "not UTF-8"),
        (("[" * 100_000 + "]" * 100_000).encode(), "nest"),
        (_bomb(9).encode(), "alias"),
        (b"budget: 1GiB\n" + b"# padding\n" * 200_000, "larger than the limit"),
    ],
    ids=["binary", "utf-16", "latin-1", "deep", "alias-bomb", "oversized"],
)
def test_hostile_recipe_files_are_a_recipe_error_naming_the_file(tmp_path: Path, content: bytes, expected: str) -> None:
    # Each used to escape as UnicodeDecodeError, RecursionError or MemoryError (after 72 s for the bomb).
    path = tmp_path / "hostile.yaml"
    path.write_bytes(content)
    with pytest.raises(R.RecipeError) as info:
        R.load(path)
    assert info.value.source == str(path)
    assert len(info.value.errors) == 1 and expected in info.value.errors[0], info.value.errors
    assert len(str(info.value)) < 1000  # nothing of the file is echoed in bulk


def test_an_echoed_value_is_clipped(tmp_path: Path) -> None:
    huge = "x" * 100_000
    errors = _errors({"budget": huge})
    assert len(errors) == 1 and "budget" in errors[0] and len(errors[0]) < 1000, errors


@pytest.mark.parametrize("batch_size", [0, -2, "8", 2.5, True])
def test_a_batch_size_that_is_not_positive_is_refused_at_load(batch_size: Any) -> None:
    # Every trial used to fail building its loader, after the session had profiled and searched.
    errors = _errors({"budget": "1GiB", "data": {"init_args": {"batch_size": batch_size}}})
    assert any(e.startswith("data.init_args.batch_size:") and "positive integer" in e for e in errors), errors


def test_a_constructor_refusing_its_arguments_is_a_recipe_error() -> None:
    recipe = R.from_dict({"budget": "1GiB", "model": {"init_args": {"n_embd": 30, "n_head": 4}}})
    with pytest.raises(R.RecipeError) as info:
        R.build_model(recipe)
    (line,) = info.value.errors
    assert line.startswith("model.init_args:") and "not divisible by n_head=4" in line, line


def test_class_path_beside_the_recipe_is_importable(tmp_path: Path) -> None:
    (tmp_path / "my_models_for_recipe_test.py").write_text(
        "from lightning_recompute.reference import ReferenceGPT\n\nclass Mine(ReferenceGPT):\n    pass\n"
    )
    recipe = R.load(
        _write(
            tmp_path,
            {"budget": "1GiB", "model": {"class_path": "my_models_for_recipe_test.Mine", "init_args": {"n_layer": 2}}},
        )
    )
    model = R.build_model(recipe)
    assert type(model).__name__ == "Mine" and isinstance(model, ReferenceGPT) and len(model.blocks) == 2
    # A subclass of the reference model still gets matched synthetic data.
    assert recipe.data.init_args == {"vocab_size": 256, "seq_len": 64}


# ---------------------------------------------------------------------------------------------- building


def test_build_model_and_datamodule_with_micro_batch_override() -> None:
    recipe = R.from_dict(
        {
            "budget": "1GiB",
            "model": {"init_args": {"n_layer": 2, "n_embd": 32}},
            "data": {"init_args": {"batch_size": 3}},
        }
    )
    model = R.build_model(recipe)
    assert isinstance(model, ReferenceGPT) and len(model.blocks) == 2
    dm = R.build_datamodule(recipe)
    assert isinstance(dm, SyntheticTokens) and dm.batch_size == 3
    resized = R.build_datamodule(recipe, micro_batch=7)
    assert isinstance(resized, SyntheticTokens) and resized.batch_size == 7
    assert R.build_model(recipe) is not model  # fresh each time


def test_json_schema_is_json_schema_and_lists_every_key() -> None:
    schema = R.json_schema()
    text = json.dumps(schema)  # plain JSON
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False
    assert schema["required"] == ["budget"]
    assert set(schema["properties"]) == {
        "name",
        "model",
        "data",
        "trainer",
        "layers",
        "budget",
        "search",
        "trial",
        "race",
        "tracking",
        "study",
        "output",
    }
    for key, prop in schema["properties"].items():
        assert prop.get("description"), key
    defs = schema["$defs"]
    for section in ("TrainerSettings", "SearchSettings", "TrialSettings", "RaceSettings", "Budget", "Component"):
        assert defs[section]["additionalProperties"] is False
        assert set(defs[section]["properties"]) == {f.name for f in dataclasses.fields(getattr(S, section))}
    assert defs["TrainerSettings"]["properties"]["accelerator"]["enum"] == ["cpu", "cuda", "auto"]
    assert "$ref" in text
    try:
        import jsonschema  # type: ignore[import-untyped]  # jsonschema ships no type information
    except ImportError:
        return
    jsonschema.Draft202012Validator.check_schema(schema)
    for shipped in ("quickstart.yaml", "llama-8gpu-fsdp.yaml"):
        jsonschema.validate(yaml.safe_load((REPO / "recipes" / shipped).read_text()), schema)
    strategy = defs["TrainerSettings"]["properties"]["strategy"]
    assert {"enum": ["auto", "ddp", "fsdp", "model_parallel"], "type": "string"} in strategy["anyOf"], strategy


def test_multi_device_trainer_settings_and_their_fingerprint() -> None:
    single = R.from_dict({"budget": "1GiB"})
    assert (single.trainer.devices, single.trainer.num_nodes, single.trainer.strategy) == (1, 1, "auto")
    # Keys added with multi-device trials stay out of the fingerprint at their defaults, so studies
    # made before them still resume: the quickstart's fingerprint as it was before they existed (less the
    # CPU cap it has since set in its trial.env: a capped device is another device, and another study).
    quickstart = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
    del quickstart["trial"]["env"]["RECOMPUTE_CPU_MEMORY_LIMIT"]
    assert R.from_dict(quickstart).fingerprint() == "56f2dccc65f5b7d8"
    ddp = R.from_dict({"budget": "1GiB", "trainer": {"devices": 2, "num_nodes": 4, "strategy": "ddp"}})
    assert (ddp.trainer.world_size, ddp.trainer.strategy_name) == (8, "ddp")
    assert single.trainer.describe_ranks() is None
    auto = R.from_dict({"budget": "1GiB", "trainer": {"devices": 2}}).trainer
    assert auto.describe_ranks() == (
        "2 ranks per trial (auto: Lightning runs DDP on several devices); peak = the highest rank's, "
        "throughput = all ranks'"
    )
    assert ddp.fingerprint() != single.fingerprint()
    custom = {"class_path": "lightning.pytorch.strategies.DDPStrategy", "init_args": {"find_unused_parameters": True}}
    recipe = R.from_dict({"budget": "1GiB", "trainer": {"devices": 2, "strategy": custom}})
    assert recipe.trainer.strategy == S.Component(**custom)
    assert recipe.trainer.strategy_name == "lightning.pytorch.strategies.DDPStrategy"
    assert R.from_dict(recipe.to_dict()) == recipe


def test_precision_choices_match_lightning() -> None:
    from lightning.fabric.connector import _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS_CONVERSION

    assert set(S.PRECISIONS) == set(typing.get_args(_PRECISION_INPUT_STR))
    from tuner.recipe._schema import _PRECISION_ALIASES

    assert _PRECISION_ALIASES == _PRECISION_INPUT_STR_ALIAS_CONVERSION
    assert R.from_dict({"budget": "1GiB", "trainer": {"precision": "bf16"}}).trainer.precision == "bf16-mixed"
    assert R.from_dict({"budget": "1GiB", "trainer": {"precision": 32}}).trainer.precision == "32-true"


# ---------------------------------------------------------------------------------------------- shipped recipes


def test_quickstart_budget_forces_a_mixed_policy() -> None:
    """At the quickstart budget, "none" does not fit, "full" does, and so do policies in between.

    Runs the worker's own trial code in this process (no subprocess startup), so the peaks are
    exactly what a tuning session measures.
    """
    from tuner._trials import worker

    recipe = R.load(REPO / "recipes" / "quickstart.yaml")
    assert recipe.trainer.accelerator == "cpu"
    limit = recipe.budget.limit_bytes(None)
    names = [f"blocks.{i}" for i in range(recipe.model.init_args["n_layer"])]
    policies = {
        "none": RecomputePolicy.uniform("none"),
        "full": RecomputePolicy.uniform("full"),
        "half full": RecomputePolicy.first_n(names, len(names) // 2, "full"),
    }
    peaks = {}
    for label, policy in policies.items():
        spec = {
            "recipe": recipe.to_dict(),
            "source": str(recipe.source),
            "policy": policy.to_dict(),
            "micro_batch": None,
            "warmup_steps": 1,
            "measure_steps": 1,
        }
        result = worker._trial(spec)
        peaks[label] = max(s["peak_bytes"] for s in result["steps"] if s["peak_bytes"] is not None)
    assert peaks["none"] > limit, peaks
    assert peaks["full"] < peaks["half full"] < limit, peaks


def test_eight_gpu_recipe_loads_as_fsdp2_over_one_node() -> None:
    from lightning_recompute.reference import ShardedGPT

    recipe = R.load(REPO / "recipes" / "llama-8gpu-fsdp.yaml")
    trainer = recipe.trainer
    assert (trainer.accelerator, trainer.devices, trainer.num_nodes) == ("cuda", 8, 1)
    assert (trainer.strategy, trainer.precision) == ("model_parallel", "bf16-mixed")
    assert recipe.model.import_class() is ShardedGPT and recipe.budget.is_fraction
    assert "NOT MEASURED" in (REPO / "recipes" / "llama-8gpu-fsdp.yaml").read_text().splitlines()[0]


def test_gpu_recipe_describes_a_billion_parameter_model() -> None:
    recipe = R.load(REPO / "recipes" / "gpt-1b-h100.yaml")
    assert recipe.trainer.accelerator == "cuda" and recipe.trainer.precision == "bf16-mixed"
    assert recipe.budget.is_fraction
    assert recipe.data.init_args["seq_len"] == recipe.model.init_args["seq_len"] == 2048
    with torch.device("meta"):  # sizes without allocating
        model = R.build_model(recipe)
    n_params = sum(p.numel() for p in model.parameters())
    assert 0.9e9 < n_params < 1.5e9, n_params


@pytest.mark.parametrize(
    ("output", "extra", "key"),
    [
        ("optuna.db", {}, "study.storage"),
        ("mlflow.db", {}, "tracking.uri"),
        ("mlflow.db-wal", {}, "tracking.uri"),
        ("runs/optuna.log", {"study": {"storage": "runs/optuna.log"}}, "study.storage"),
    ],
    ids=["optuna-db", "mlflow-db", "sqlite-wal", "journal"],
)
def test_an_output_naming_a_store_file_is_refused_at_load(
    tmp_path: Path, output: str, extra: dict[str, Any], key: str
) -> None:
    # A promotion used to write the policy over optuna.db (every trial lost) or mlflow.db.
    path = _write(tmp_path, {"budget": "1GiB", "output": output, **extra})
    with pytest.raises(R.RecipeError) as info:
        R.load(path)
    assert info.value.source == str(path)
    (error,) = info.value.errors
    assert error.startswith(f"output: {tmp_path / output} is a file of the store in {key}"), error
    assert "policy.yaml" in error


def test_an_output_reaching_a_store_through_a_symlink_is_refused(tmp_path: Path) -> None:
    (tmp_path / "optuna.db").touch()
    (tmp_path / "link.yaml").symlink_to(tmp_path / "optuna.db")
    with pytest.raises(R.RecipeError, match=r"is a file of the store in study\.storage"):
        R.load(_write(tmp_path, {"budget": "1GiB", "output": "link.yaml"}))


def test_environment_variables_in_paths_are_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `output: ${HOME}/...` used to make a folder literally named "${HOME}".
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RUNS", str(tmp_path / "runs"))
    recipe = R.load(
        _write(
            tmp_path,
            {
                "budget": "1GiB",
                "output": "${HOME}/policies/p.yaml",
                "tracking": {"uri": "sqlite:///$RUNS/mlflow.db"},
                "study": {"storage": "${RUNS}/optuna.log"},
            },
        )
    )
    assert recipe.output == tmp_path / "home" / "policies" / "p.yaml"
    assert recipe.tracking.uri == f"sqlite:///{tmp_path}/runs/mlflow.db"
    assert recipe.study.storage == str(tmp_path / "runs" / "optuna.log")


def test_an_unset_environment_variable_in_a_path_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_SUCH_VAR_24", raising=False)
    path = _write(tmp_path, {"budget": "1GiB", "output": "${NO_SUCH_VAR_24}/p.yaml"})
    with pytest.raises(R.RecipeError) as info:
        R.load(path)
    assert info.value.errors == [
        "output: ${NO_SUCH_VAR_24}/p.yaml names environment variable(s) not set here: ${NO_SUCH_VAR_24} "
        "(valid: set them, or give the path itself)"
    ]
