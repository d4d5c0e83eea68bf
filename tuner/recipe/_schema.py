"""The recipe file's schema as pydantic dataclasses, and the validated `Recipe` (docs/TUNER.md, Recipes)."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
import inspect
import json
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

from pydantic import BeforeValidator, ConfigDict, Field, Strict, TypeAdapter, WithJsonSchema
from pydantic.dataclasses import dataclass as schema_dataclass

from lightning_recompute.errors import RecomputeError, clip
from lightning_recompute.modes import FAMILY_NAMES, MODE_NAMES
from lightning_recompute.race import RacePlan
from lightning_recompute.units import format_bytes as _format_bytes
from lightning_recompute.units import jsonable, parse_bytes

PREDICTION_SPAN = 0.05  # predicted step times this close to the fastest are a tie: the cost model cannot rank them
RACE_PLAN_ENV = "RECOMPUTE_TUNE_RACE_PLAN"  # JSON of `RacePlan` fields replacing its constants (tests, benchmarks)

REFERENCE_MODEL = "lightning_recompute.reference.ReferenceGPT"  # when a recipe names no model
REFERENCE_DATA = "lightning_recompute.reference.SyntheticTokens"  # when it names no data

PRECISIONS = (
    "transformer-engine",
    "transformer-engine-float16",
    "16-true",
    "16-mixed",
    "bf16-true",
    "bf16-mixed",
    "32-true",
    "64-true",
)
"""Lightning's ``Trainer(precision=...)`` values, spelt out so that loading a recipe does not import Lightning."""
_PRECISION_ALIASES = {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}


class RecipeError(RecomputeError, ValueError):
    """A recipe is invalid; `errors` holds every problem found, each ``key.path: problem (valid: ...)``."""

    def __init__(self, errors: list[str], source: str | os.PathLike[str] | None = None) -> None:
        self.errors = list(errors)
        self.source = None if source is None else str(source)
        where = self.source or "recipe"
        noun = "problem" if len(self.errors) == 1 else "problems"
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"{where}: {len(self.errors)} {noun}:\n{lines}")


_SCHEMA = ConfigDict(extra="forbid")
_Int = Annotated[int, Strict()]  # YAML gives real ints; `true` or "8" for an integer is a mistake, not a 1 or an 8
_PositiveInt = Annotated[int, Strict(), Field(ge=1)]


@schema_dataclass(frozen=True, config=_SCHEMA)
class Component:
    """A class and its constructor arguments, the LightningCLI way (``class_path`` + ``init_args``)."""

    class_path: str = Field(description="Importable dotted path of the class, e.g. my_project.models.MyModule.")
    init_args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the class's __init__; checked against its signature."
    )

    def import_class(self) -> type:
        cls, problem = resolve_class(self.class_path)
        if cls is None:
            raise RecipeError([f"class_path: {problem}"])
        return cls

    def instantiate(self, **overrides: Any) -> Any:
        return self.import_class()(**{**self.init_args, **overrides})


def _precision(value: Any) -> str:
    text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    text = _PRECISION_ALIASES.get(str(text), text)
    if text in PRECISIONS:
        return text
    raise ValueError(
        f"{clip(repr(value))} is not valid{suggest(str(value), PRECISIONS)} "
        f"(valid: {', '.join(PRECISIONS)}; aliases {', '.join(_PRECISION_ALIASES)})"
    )


STRATEGIES = ("auto", "ddp", "fsdp", "model_parallel")
StrategyName = Literal["auto", "ddp", "fsdp", "model_parallel"]


def _strategy(value: Any) -> Any:
    """A known strategy name, or a mapping left for `Component` to validate."""
    if isinstance(value, (Mapping, Component)) or (isinstance(value, str) and value in STRATEGIES):
        return value
    what = f"valid{suggest(value, STRATEGIES)}" if isinstance(value, str) else "a strategy"
    raise ValueError(
        f"{clip(repr(value))} is not {what} (valid: {', '.join(STRATEGIES)}, "
        "or {class_path: ..., init_args: {...}})"
    )


@schema_dataclass(frozen=True, config=_SCHEMA)
class TrainerSettings:
    """The Lightning ``Trainer`` arguments a trial runs with."""

    accelerator: Literal["cpu", "cuda", "auto"] = Field(
        default="cpu", description="Where trials run; 'auto' picks CUDA when available."
    )
    devices: _PositiveInt = Field(
        default=1,
        description="Devices (ranks) per node of every trial. Above 1, a trial runs that many ranks under "
        "`strategy`; its peak is the maximum over ranks and its throughput the sum.",
    )
    precision: Annotated[str, BeforeValidator(_precision)] = Field(
        default="32-true",
        description="Lightning precision: " + ", ".join(PRECISIONS) + " (or the aliases 32, 16, bf16, 64).",
        json_schema_extra={"enum": [*PRECISIONS, *_PRECISION_ALIASES]},
    )
    num_nodes: _PositiveInt = Field(
        default=1,
        description="Nodes of the training job. Trials run on one node (the tuner launches its ranks itself); "
        "more nodes are for planning the job's world size, devices * num_nodes.",
    )
    strategy: Annotated[StrategyName | Component, Field(union_mode="left_to_right"), BeforeValidator(_strategy)] = (
        Field(
            default="auto",
            description="Lightning strategy of every trial: auto (one device; DDP with several, as Lightning picks), "
            "ddp, fsdp (Lightning's FSDPStrategy, FSDP1: CUDA only), model_parallel (ModelParallelStrategy with "
            "data_parallel_size = all ranks, tensor_parallel_size = 1: FSDP2 through the model's configure_model), "
            "or {class_path: a lightning.pytorch.strategies.Strategy subclass, init_args: {...}}.",
        )
    )

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def strategy_name(self) -> str:
        """The strategy as one word for logs: its name, or the ``class_path`` of a custom one."""
        return self.strategy if isinstance(self.strategy, str) else self.strategy.class_path

    def describe_ranks(self) -> str | None:
        if self.devices == 1:
            return None
        how = "auto: Lightning runs DDP on several devices" if self.strategy == "auto" else self.strategy_name
        return f"{self.devices} ranks per trial ({how}); peak = the highest rank's, throughput = all ranks'"


def _budget_value(value: Any) -> int | float:
    """Bytes (an int or a size string) or a fraction of device memory (a float in (0, 1] or "80%")."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            pct = float(value.strip()[:-1])
        except ValueError:
            raise ValueError(f"{clip(repr(value))} is not a percentage (valid: e.g. '80%')") from None
        if not 0 < pct <= 100:
            raise ValueError(f"{clip(repr(value))}: a percentage of device memory must be in (0%, 100%]")
        return pct / 100
    if isinstance(value, float):
        if not (math.isfinite(value) and 0 < value <= 1):
            raise ValueError(
                f"{clip(repr(value))}: a float is a fraction of device memory and must be in (0, 1]; "
                f"for an absolute budget give bytes as an integer or a size like '20GiB'"
            )
        return value
    return parse_bytes(value)


_BudgetValue = Annotated[
    int | float,
    BeforeValidator(_budget_value),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 1, "description": "bytes"},
                {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "description": "fraction of device memory"},
                {
                    "type": "string",
                    "pattern": r"^\s*[0-9.]+\s*[a-zA-Z%]*\s*$",
                    "description": "'20GiB', '20GB' or '80%'",
                },
            ]
        }
    ),
]


@schema_dataclass(frozen=True, config=_SCHEMA)
class Budget:
    """The device memory a policy may use: absolute bytes, or a fraction of the device, less a safety margin."""

    value: _BudgetValue = Field(
        description="Bytes (20GiB, 20GB, 21474836480) or a fraction of the device's memory (0.8 or '80%'). "
        "Stored as an int (bytes) or a float (fraction)."
    )
    margin: float = Field(
        default=0.05,
        ge=0.0,
        lt=0.5,
        description="Fraction of the budget kept free: allocator fragmentation and run-to-run variation the "
        "short trials do not see. A policy must measure under value * (1 - margin).",
    )

    @property
    def is_fraction(self) -> bool:
        return isinstance(self.value, float)

    def limit_bytes(self, device_total_bytes: int | None) -> int:
        """The most bytes a trial's peak may reach: the budget, less the margin."""
        if self.is_fraction and device_total_bytes is None:
            raise RecomputeError(
                f"budget.value: {self.value:g} is a fraction of device memory, but this device reports no "
                f"total memory (CPU); give bytes instead, e.g. '20GiB'"
            )
        budget = self.value * (device_total_bytes or 0) if self.is_fraction else float(self.value)
        return int(budget * (1.0 - self.margin))

    def describe(self, device_total_bytes: int | None = None) -> str:
        """``"80% of 79.19 GiB, less 5% margin -> limit 60.17 GiB"``."""
        of = "device memory" if device_total_bytes is None else _format_bytes(device_total_bytes)
        base = f"{self.value:.0%} of {of}" if self.is_fraction else _format_bytes(int(self.value))
        unknown = self.is_fraction and device_total_bytes is None
        limit = "" if unknown else f" -> limit {_format_bytes(self.limit_bytes(device_total_bytes))}"
        return f"{base}, less {self.margin:.0%} margin{limit}"


RETIRED_RACE_KEYS = (
    "predicted",
    "steps",
    "min_rounds",
    "max_rounds",
    "time_s",
    "min_s",
    "estimate_rounds",
    "processes",
    "rivals",
    "disputes",
    "tie_margin",
)
"""``race`` keys of earlier recipes, now `RacePlan`'s constants: a recipe setting them loads, with a warning."""


def _race_override(text: str) -> dict[str, Any]:
    """`RACE_PLAN_ENV`'s fields, every one a `RacePlan` field: a typo would otherwise be dropped unseen."""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as err:
        raise RecomputeError(f"{RACE_PLAN_ENV}: not JSON ({err}): {clip(text)}") from None
    valid = sorted(f.name for f in dataclasses.fields(RacePlan))
    unknown = sorted(k for k in fields if k not in valid) if isinstance(fields, dict) else None
    if unknown is None or unknown:
        what = f"{', '.join(map(repr, unknown))} not RacePlan fields" if unknown else "not a JSON object"
        raise RecomputeError(f"{RACE_PLAN_ENV}: {what} (valid: {', '.join(valid)})")
    return fields


def _race_retired_keys(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    retired = sorted(k for k in value if k in RETIRED_RACE_KEYS)
    if retired:
        warnings.warn(
            f"race.{', race.'.join(retired)}: no longer recipe settings, ignored (the race's constants, "
            "docs/TUNER.md); the race's settings are enabled, leaders, confidence and share",
            stacklevel=2,
        )
    return {k: v for k, v in value.items() if k not in RETIRED_RACE_KEYS}


def _budget_shorthand(value: Any) -> Any:
    # `budget: 20GiB` is the common case; it means {value: 20GiB} with the default margin.
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return {"value": value}
    return value


if TYPE_CHECKING:  # a Literal must be spelled out for a type checker; the names are checked at run time
    ModeName = str
else:
    ModeName = Literal[MODE_NAMES]


@schema_dataclass(frozen=True, config=_SCHEMA)
class SearchSettings:
    """How the Optuna study searches."""

    modes: tuple[ModeName, ...] = Field(
        default=("none", "selective", "full"),
        min_length=1,
        description="Recompute modes a layer may take. 'offload' (activations in host memory) helps on CUDA only. "
        "'selective:<family>' is selective recomputation with a named save list "
        f"(lightning_recompute.selective.SAVE_FAMILIES): {', '.join(FAMILY_NAMES)}.",
    )
    compile: tuple[bool, ...] = Field(
        default=(False,),
        min_length=1,
        description="Whether trials torch.compile each layer (per block, around its recompute wrapper): "
        "[false, true] searches both. The planner predicts eager steps; trials measure compiled ones, "
        "compilation warmed up outside the timed steps.",
    )
    n_trials: _PositiveInt = Field(default=20, description="Trials to run (planner-skipped candidates do not count).")
    timeout_s: float | None = Field(default=None, gt=0, description="Stop starting new trials after this many seconds.")
    micro_batch_sizes: tuple[_PositiveInt, ...] | None = Field(
        default=None,
        min_length=1,
        description="Micro-batch sizes to co-tune with the policy (the data's batch_size init arg); "
        "null keeps the data module's own batch size.",
    )
    seed: _Int = Field(default=0, description="Seed of the sampler and of every trial's model and data.")


_SCAN_BATCHES = 64
_ADDED_LATER: dict[str, dict[str, Any]] = {
    "trial": {"scan_batches": _SCAN_BATCHES},
    "trainer": {"num_nodes": 1, "strategy": "auto"},
    "search": {"compile": [False]},
}
"""Keys added after studies existed, left out of the recipe's fingerprint at these defaults."""


# YAML reads `OMP_NUM_THREADS: 1` as an int; an environment holds strings.
@schema_dataclass(frozen=True, config=ConfigDict(extra="forbid", coerce_numbers_to_str=True))
class TrialSettings:
    """How long one trial measures."""

    warmup_steps: Annotated[int, Strict(), Field(ge=0)] = Field(
        default=2, description="Training steps run first and not timed (allocator warm-up, lazy init, autotuning)."
    )
    measure_steps: _PositiveInt = Field(
        default=5, description="Training steps timed after warm-up; the median is used."
    )
    timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="Wall-clock limit of one trial's subprocess (startup included); then it is killed.",
    )
    scan_batches: _PositiveInt = Field(
        default=_SCAN_BATCHES,
        description="Batches of the data module scanned before a trial for the largest (the whole epoch when it "
        "is shorter). When batches vary, every measured step uses the largest found, so 'fits the budget' "
        "holds for it; the session says which batch that was and whether the scan saw the whole epoch.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables of every trial subprocess, e.g. {OMP_NUM_THREADS: 1}: on a shared CPU, "
        "one thread per trial gives far steadier step times than threads fighting over cores.",
    )


@schema_dataclass(frozen=True, config=_SCHEMA)
class RaceSettings:
    """The race before the gate: the leading trials measured again, interleaved in one process. The race's other
    settings are constants of `lightning_recompute.race.RacePlan`, each with its reason."""

    enabled: bool = Field(
        default=True,
        description="Race the leaders before the gate. Off: the best single trial is gated, and no 'vs' figure is "
        "printed (single trials are not comparable).",
    )
    leaders: _PositiveInt = Field(
        default=4, description="How many of the fastest fitting trials race (besides the planner's pick and baselines)."
    )
    confidence: float = Field(
        default=0.95, gt=0.5, lt=1.0, description="Confidence of the intervals, and of telling two candidates apart."
    )
    share: float | None = Field(
        default=0.25,
        gt=0,
        description="The race's rounds take at most this share of the time the search's trials took (never under "
        "30 s); null: only the race's own round and time limits bound it.",
    )


@schema_dataclass(frozen=True, config=_SCHEMA)
class TrackingSettings:
    """Where MLflow records sessions, trials and decisions."""

    uri: str = Field(
        default="sqlite:///mlflow.db",
        min_length=1,
        description="MLflow tracking URI; a relative sqlite path or plain folder resolves against the recipe folder.",
    )
    experiment: str | None = Field(
        default=None, min_length=1, description="MLflow experiment; default: the recipe name."
    )


@schema_dataclass(frozen=True, config=_SCHEMA)
class StudySettings:
    """Where the Optuna study lives (so a session resumes, and several workers share it)."""

    storage: str | None = Field(
        default=None,
        min_length=1,
        description="Optuna storage URL (sqlite:///optuna.db, postgresql://...) or a journal file path "
        "ending in .log; default: optuna.db beside the recipe.",
    )
    name: str | None = Field(
        default=None, min_length=1, description="Study name; default: from the recipe name and the hardware."
    )


_NonEmpty = Annotated[str, Field(min_length=1)]


def _layers_value(value: Any) -> Any:
    # One error naming the valid forms, rather than one per member of the union.
    value = tuple(value) if isinstance(value, list) else value
    items = value if isinstance(value, tuple) else (value,)
    if not items or not all(isinstance(v, str) and v.strip() for v in items):
        raise ValueError(
            f"{clip(repr(value))} is not a layer selection (valid: 'auto', or module paths, globs, or 'class:Name', "
            "as a string or a non-empty list)"
        )
    return value


@schema_dataclass(frozen=True, config=_SCHEMA)
class RecipeFile:
    """Recipe for `recompute-tune`: what to tune, on what hardware, within which memory budget."""

    budget: Annotated[Budget, BeforeValidator(_budget_shorthand)] = Field(
        description="Device memory the policy may use: bytes ('20GiB'), a fraction (0.8, '80%'), or {value, margin}."
    )
    name: str | None = Field(
        default=None, min_length=1, description="Recipe name; default: the file name without extension."
    )
    model: Component = Field(
        default_factory=lambda: Component(REFERENCE_MODEL),
        description="The LightningModule to tune; class_path defaults to the reference GPT.",
    )
    data: Component | None = Field(
        default=None,
        description="The LightningDataModule feeding it; class_path defaults to synthetic tokens, which take "
        "the reference model's vocab_size and seq_len.",
    )
    trainer: TrainerSettings = Field(default_factory=TrainerSettings, description="Trainer settings of every trial.")
    layers: Annotated[
        _NonEmpty | Annotated[tuple[_NonEmpty, ...], Field(min_length=1)], BeforeValidator(_layers_value)
    ] = Field(
        default="auto",
        description="Which modules are layers: 'auto' (the longest stack of same-class blocks), module paths, "
        "globs, or 'class:Name'.",
    )
    search: SearchSettings = Field(default_factory=SearchSettings, description="The search.")
    trial: TrialSettings = Field(default_factory=TrialSettings, description="One trial's length.")
    race: Annotated[RaceSettings, BeforeValidator(_race_retired_keys)] = Field(
        default_factory=RaceSettings, description="The race before the gate."
    )
    tracking: TrackingSettings = Field(default_factory=TrackingSettings, description="MLflow tracking.")
    study: StudySettings = Field(default_factory=StudySettings, description="Optuna study storage.")
    output: str | None = Field(
        default=None,
        min_length=1,
        description="Policy file written on promotion; default: policy.yaml beside the recipe.",
    )


FILE_ADAPTER = TypeAdapter(RecipeFile)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A validated recipe with every default filled in and every path absolute."""

    source: Path | None  # None for a recipe built from a mapping alone
    name: str
    model: Component
    data: Component
    trainer: TrainerSettings
    layers: str | tuple[str, ...]  # `lightning_recompute.layers.LayerSpec`
    budget: Budget
    search: SearchSettings
    trial: TrialSettings
    race: RaceSettings
    tracking: TrackingSettings  # experiment always set
    study: StudySettings  # storage always set; name None: derived from the hardware
    output: Path

    def race_plan(self, *, search_s: float | None = None) -> RacePlan:
        """The race's settings for a search whose trials took ``search_s`` seconds; `RACE_PLAN_ENV` overrides any."""
        r = self.race
        plan = RacePlan(
            confidence=r.confidence, leaders=r.leaders, share=r.share, warmup_steps=max(1, self.trial.warmup_steps)
        )
        override = os.environ.get(RACE_PLAN_ENV)
        if override:
            plan = RacePlan.from_dict({**plan.to_dict(), **_race_override(override)})
        return plan.within(search_s)

    @property
    def folder(self) -> Path:
        return self.source.parent if self.source is not None else Path.cwd()

    def to_dict(self) -> dict[str, Any]:
        """The file structure (plain types; `from_dict` of it gives an equal recipe)."""
        d = dataclasses.asdict(self)
        del d["source"]
        d["layers"] = self.layers if isinstance(self.layers, str) else list(self.layers)
        d["search"] = jsonable(d["search"])
        d["output"] = str(self.output)
        return d

    def fingerprint(self) -> str:
        """What the recipe measures, as a short hash: not its name, places, trial count or time limits."""
        d = self.to_dict()
        keep = {k: d[k] for k in ("model", "data", "trainer", "layers", "budget", "trial")}
        keep["search"] = {k: d["search"][k] for k in ("modes", "micro_batch_sizes", "seed", "compile")}
        # Keys added after studies existed stay out at their defaults, so those studies still resume.
        for section, defaults in _ADDED_LATER.items():
            keep[section] = {k: v for k, v in keep[section].items() if k not in defaults or defaults[k] != v}
        canonical = json.dumps(keep, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def resolve_class(class_path: str) -> tuple[type | None, str]:
    """``(class, "")`` or ``(None, why not)``."""
    module_name, _, attr = class_path.rpartition(".")
    if not module_name or not attr:
        return None, f"{class_path!r} is not a dotted path of the form package.module.ClassName"
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        return None, f"cannot import module {module_name!r} of {class_path!r}: {err}"
    except Exception as err:  # noqa: BLE001 - user code failing at import time is reported, not raised
        return None, f"importing module {module_name!r} of {class_path!r} raised {type(err).__name__}: {err}"
    obj = getattr(module, attr, None)
    if obj is None:
        public = sorted(n for n, v in vars(module).items() if inspect.isclass(v) and not n.startswith("_"))
        return None, f"module {module_name!r} has no attribute {attr!r}{suggest(attr, public)}"
    if not inspect.isclass(obj):
        return None, f"{class_path!r} is a {type(obj).__name__}, not a class"
    return obj, ""


def init_signature(cls: type) -> inspect.Signature:
    """``cls.__init__``'s (``self`` included), not ``inspect.signature(cls)``'s: no metaclass ``__call__``."""
    return inspect.signature(cast(Any, cls).__init__)


def positive_arg(component: Component, name: str) -> int | None:
    """``component``'s ``name`` argument (in its init_args, else its constructor's default) when a positive int."""
    value = component.init_args.get(name)
    if value is None:
        try:
            param = init_signature(component.import_class()).parameters.get(name)
        except (TypeError, ValueError, RecipeError):
            return None
        value = None if param is None else param.default
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def accepts(cls: type, name: str) -> bool:
    """Whether ``cls.__init__`` takes a keyword ``name`` (or ``**kwargs``); ``True`` when it cannot be read."""
    try:
        params = init_signature(cls).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def suggest(word: str, choices: Any) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``choices`` to a misspelt ``word``, or ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
