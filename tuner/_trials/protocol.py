"""The parent/child protocol of the trial worker: one typed spec per kind of measurement, written as JSON by
the parent (`Spec.to_dict`) and read by the child (`parse_spec`); recipes and policies travel as their
``to_dict`` forms."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PARENT_PID_ENV = "RECOMPUTE_TUNE_PARENT_PID"
"""In a worker's environment, the pid of its parent (the tuner, or the fork server): it ends when that dies."""

_S = TypeVar("_S", bound="Spec")


class ProtocolError(ValueError):
    """A spec the worker cannot read."""


class Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: ClassVar[str] = ""
    ranked: ClassVar[bool] = False  # runs on the recipe's ``trainer.devices`` ranks

    deadline: float | None = None
    """When (``time.time()``) the parent kills the worker; the worker dumps its stacks just before."""
    sys_path: tuple[str, ...] = ()
    """Where the parent could import the user's class_path from, appended to the child's ``sys.path``."""

    @property
    def trainer(self) -> Mapping[str, Any]:
        return {}

    @property
    def runs_on(self) -> str:
        return str(self.trainer.get("accelerator", "cpu"))

    @property
    def ranks(self) -> int:
        return int(self.trainer.get("devices", 1)) if self.ranked else 1

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.model_dump()}

    @classmethod
    def of(cls: type[_S], spec: Spec | Mapping[str, Any]) -> _S:
        """``spec`` itself if it is one of these, else parsed from its mapping form (``kind`` may be left out)."""
        return cast(_S, parse_spec(spec, cls))


class _RecipeSpec(Spec):
    recipe: dict[str, Any]
    source: str | None = None
    """The recipe's file, for its relative paths and its error messages."""
    micro_batch: int | None = None  # None: the data module's own

    @property
    def trainer(self) -> Mapping[str, Any]:
        return dict(self.recipe.get("trainer", {}))


class TrialSpec(_RecipeSpec):
    kind: ClassVar[str] = "trial"
    ranked: ClassVar[bool] = True
    policy: dict[str, Any]
    warmup_steps: int
    measure_steps: int


class NumericsSpec(_RecipeSpec):
    kind: ClassVar[str] = "numerics"
    ranked: ClassVar[bool] = True
    policy: dict[str, Any]


class ProfileSpec(_RecipeSpec):
    kind: ClassVar[str] = "profile"
    repeats: int


class RaceEntrant(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    key: str  # the policy's fingerprint
    policy: dict[str, Any]
    short: str


class RaceSpec(_RecipeSpec):
    kind: ClassVar[str] = "race"
    entrants: tuple[RaceEntrant, ...]
    references: tuple[str, ...] = ()
    """Keys of the entrants the winner's "vs" figures are about."""
    budget_bytes: int | None = None
    plan: dict[str, Any] = Field(default_factory=dict)


class DeviceSpec(Spec):
    kind: ClassVar[str] = "device"
    accelerator: str

    @property
    def trainer(self) -> Mapping[str, Any]:
        return {"accelerator": self.accelerator}


SPEC_TYPES: Mapping[str, type[Spec]] = {
    cls.kind: cls for cls in (TrialSpec, NumericsSpec, DeviceSpec, ProfileSpec, RaceSpec)
}


def parse_spec(data: Any, expected: type[Spec] | None = None) -> Spec:
    """The spec a parent wrote (`Spec.to_dict`) as its kind's class; a `ProtocolError` naming every problem."""
    if isinstance(data, Spec):
        if expected is not None and not isinstance(data, expected):
            raise ProtocolError(f"expected a {expected.kind} spec, got a {data.kind} spec")
        return data
    if not isinstance(data, Mapping):
        raise ProtocolError(f"a spec is a JSON object, got {type(data).__name__}")
    kind = data.get("kind", expected and expected.kind)
    cls = SPEC_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None or cls is not (expected or cls):
        valid = expected.kind if expected else ", ".join(SPEC_TYPES)
        raise ProtocolError(f"unknown spec kind {kind!r}; valid: {valid}")
    try:
        return cls.model_validate({k: v for k, v in data.items() if k != "kind"})
    except ValidationError as err:
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
        raise ProtocolError(f"{kind} spec: {'; '.join(problems)}") from None


def rank_result_path(result_path: Path, rank: int) -> Path:
    """``result.rank1.json``."""
    return result_path.with_name(f"{result_path.stem}.rank{rank}{result_path.suffix}")


@dataclass(frozen=True)
class NumericsResult:
    """Whether a policy changes one training step's loss, gradients or module state."""

    equal: bool
    """Equal to training without recomputation: bitwise, or within the spread of two runs without it."""
    max_abs_diff: float
    detail: str
    """What was compared (at which micro-batch), or what differed and where."""
    baseline_spread: float = 0.0
    """The largest absolute difference between two runs without recomputation (0.0: reproducible)."""
    micro_batch: int | None = None
    """The micro-batch compared: smaller than requested where no recompute fits."""
