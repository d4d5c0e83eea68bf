"""The parent/child protocol of the trial worker: one typed spec per kind of measurement, as JSON.

The parent (`tuner._trials.runner`) writes a spec's `Spec.to_dict` as ``SPEC.json`` and runs
``python -m tuner._trials.worker SPEC.json RESULT.json``; the child reads it back with `parse_spec`.
The kinds are `SPEC_TYPES`; the `RANKED_KINDS` run on the recipe's ``trainer.devices`` ranks, each
writing its own result (`rank_result_path`). A version or kind the child does not know is a
`ProtocolError` naming it; a mapping without a ``version`` is version 1. Recipes and policies travel
as their own ``to_dict`` forms and are built in the child.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "KINDS",
    "PARENT_PID_ENV",
    "PROTOCOL_VERSION",
    "RANKED_KINDS",
    "SPEC_TYPES",
    "SUPPORTED_VERSIONS",
    "DeviceSpec",
    "NumericsPayload",
    "NumericsSpec",
    "ProfileSpec",
    "ProtocolError",
    "RaceEntrant",
    "RaceSpec",
    "Spec",
    "TrialSpec",
    "parse_spec",
    "rank_result_path",
]

PROTOCOL_VERSION = 1
"""The version this parent writes."""
SUPPORTED_VERSIONS: tuple[int, ...] = (1,)
"""The versions this child reads."""
PARENT_PID_ENV = "RECOMPUTE_TUNE_PARENT_PID"
"""In a worker's environment, the pid of its parent (the tuner, or the fork server): it ends when that dies."""


class ProtocolError(ValueError):
    """A spec or result the other side cannot read: unknown version or kind, a missing, unknown or mistyped key."""


_M = TypeVar("_M", bound="_Message")
_S = TypeVar("_S", bound="Spec")


def _check_version(what: str, version: Any) -> None:
    if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
        raise ProtocolError(
            f"{what}: protocol version {version!r} is not supported; this worker reads version(s) "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}"
        )


def problems(err: ValidationError, valid: Iterable[str] = ()) -> str:
    """What pydantic found wrong, as a spec's reader words it: unknown keys (and the ``valid`` ones),
    missing keys, then each bad value."""
    unknown, missing, values = [], [], []
    for e in err.errors():
        where = ".".join(map(str, e["loc"]))
        if e["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            unknown.append(where)
        elif e["type"] in ("missing", "missing_argument"):
            missing.append(where)
        else:
            values.append(f"{where} = {e['input']!r:.80}: {e['msg']}")
    out = []
    if unknown:
        out.append(f"unknown key(s) {sorted(unknown)}" + (f"; valid: {sorted(valid)}" if valid else ""))
    if missing:
        out.append(f"missing key(s) {sorted(missing)}")
    return "; ".join(out + values)


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = PROTOCOL_VERSION

    @classmethod
    def _parse(cls: type[_M], data: Mapping[str, Any], what: str, envelope: tuple[str, ...]) -> _M:
        """``data`` less its ``envelope`` keys, validated; a `ProtocolError` naming every problem."""
        try:
            return cls.model_validate({k: v for k, v in data.items() if k not in envelope})
        except ValidationError as err:
            raise ProtocolError(f"{what}: {problems(err, cls.model_fields)}") from None


class Spec(_Message):
    """What every spec carries. A concrete kind names itself in ``kind`` and is listed in `SPEC_TYPES`."""

    kind: ClassVar[str] = ""
    ranked: ClassVar[bool] = False
    """Whether the kind runs on the recipe's ``trainer.devices`` ranks (`RANKED_KINDS`)."""

    deadline: float | None = None
    """When (``time.time()``) the parent kills the worker; the worker dumps its stacks just before."""
    sys_path: tuple[str, ...] = ()
    """Where the parent could import the user's class_path from, appended to the child's ``sys.path``."""

    @property
    def runs_on(self) -> str:
        """The accelerator the spec measures on: the recipe's ``trainer.accelerator``, or the queried one."""
        raise NotImplementedError

    @property
    def ranks(self) -> int:
        """How many ranks run this spec: 1, or the recipe's ``trainer.devices`` for the `RANKED_KINDS`."""
        return 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, ``kind`` included."""
        return {"kind": self.kind, **self.model_dump()}

    @classmethod
    def from_dict(cls: type[_S], data: Mapping[str, Any]) -> _S:
        """The inverse of `to_dict`; ``kind`` may be left out. `ProtocolError` for what it cannot read."""
        what = f"{cls.kind} spec"
        _check_version(what, data.get("version", 1))
        if data.get("kind", cls.kind) != cls.kind:
            raise ProtocolError(f"{what}: kind is {data['kind']!r}")
        return cls._parse(data, what, ("kind",))

    @classmethod
    def of(cls: type[_S], spec: Spec | Mapping[str, Any]) -> _S:
        """``spec`` itself if it is one of these, else parsed from its mapping form (`from_dict`)."""
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, Spec):
            raise ProtocolError(f"expected a {cls.kind} spec, got a {spec.kind} spec")
        return cls.from_dict(spec)


class _RecipeSpec(Spec):
    """A measurement of a recipe's model: the recipe, where it came from, and the micro-batch."""

    recipe: dict[str, Any]
    """`tuner.recipe.Recipe.to_dict`."""
    source: str | None = None
    """The recipe's file, for its relative paths and its error messages."""
    micro_batch: int | None = None
    """The micro-batch to measure at; ``None``: the data module's own."""

    @property
    def runs_on(self) -> str:
        return str(self.recipe.get("trainer", {}).get("accelerator", "cpu"))

    @property
    def ranks(self) -> int:
        return int(self.recipe.get("trainer", {}).get("devices", 1)) if self.ranked else 1


class TrialSpec(_RecipeSpec):
    """Warm-up plus measured training steps of the recipe's model under a policy."""

    kind: ClassVar[str] = "trial"
    ranked: ClassVar[bool] = True
    policy: dict[str, Any]
    """`lightning_recompute.RecomputePolicy.to_dict`."""
    warmup_steps: int
    measure_steps: int


class NumericsSpec(_RecipeSpec):
    """One training step's loss, gradients and state under a policy against two runs without it."""

    kind: ClassVar[str] = "numerics"
    ranked: ClassVar[bool] = True
    policy: dict[str, Any]
    """`lightning_recompute.RecomputePolicy.to_dict`."""


class ProfileSpec(_RecipeSpec):
    """The recipe's per-layer cost profile (`tuner.recipe._profile`), each layer measured ``repeats`` times."""

    kind: ClassVar[str] = "profile"
    repeats: int


class RaceEntrant(BaseModel):
    """One policy in a race: its key (the policy's fingerprint), the policy, and its glyphs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str
    policy: dict[str, Any]
    """`lightning_recompute.RecomputePolicy.to_dict`."""
    short: str


class RaceSpec(_RecipeSpec):
    """Several policies raced in turn on one model in one fit (`lightning_recompute.race.engine`)."""

    kind: ClassVar[str] = "race"
    entrants: tuple[RaceEntrant, ...]
    references: tuple[str, ...] = ()
    """Keys of the entrants the winner's "vs" figures are about."""
    budget_bytes: int | None = None
    """An entrant peaking over it is out of the race."""
    plan: dict[str, Any] = Field(default_factory=dict)
    """`lightning_recompute.race.RacePlan.to_dict`."""


class DeviceSpec(Spec):
    """The name and total memory of the device ``accelerator`` selects."""

    kind: ClassVar[str] = "device"
    accelerator: str

    @property
    def runs_on(self) -> str:
        return self.accelerator


SPEC_TYPES: Mapping[str, type[Spec]] = {
    cls.kind: cls for cls in (TrialSpec, NumericsSpec, DeviceSpec, ProfileSpec, RaceSpec)
}
"""Every kind of spec, by its ``kind``: the one list of them."""
KINDS: tuple[str, ...] = tuple(SPEC_TYPES)
RANKED_KINDS: tuple[str, ...] = tuple(kind for kind, cls in SPEC_TYPES.items() if cls.ranked)


def parse_spec(data: Any) -> Spec:
    """The spec a parent wrote (`Spec.to_dict`), as its kind's class; `ProtocolError` for what it cannot read."""
    if not isinstance(data, Mapping):
        raise ProtocolError(f"a spec is a JSON object, got {type(data).__name__}")
    kind = data.get("kind")
    _check_version(f"{kind} spec" if isinstance(kind, str) else "spec", data.get("version", 1))
    cls = SPEC_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown spec kind {kind!r}; valid: {', '.join(KINDS)}")
    return cls.from_dict(data)


def rank_result_path(result_path: Path, rank: int) -> Path:
    """Where rank ``rank`` of a multi-rank run writes its own result (``result.rank1.json``)."""
    return result_path.with_name(f"{result_path.stem}.rank{rank}{result_path.suffix}")


class NumericsPayload(_Message):
    """A ``numerics`` worker's measurement (its result's ``outcome`` is ``ok``)."""

    equal: bool
    """Loss and every gradient equal to the run without recompute (bitwise, or within a stated tolerance)."""
    max_abs_diff: float
    baseline_spread: float = 0.0
    """The largest absolute difference between two runs without recompute."""
    micro_batch: int | None = None
    """The micro-batch compared."""
    detail: str
    device: str = ""
    device_total_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The worker's result: ``outcome`` ``ok`` and every field (JSON-ready)."""
        return {"outcome": "ok", **self.model_dump()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NumericsPayload:
        """The inverse of `to_dict`, past the result's ``outcome`` and ``rank``; `ProtocolError` if unreadable."""
        what = "numerics result"
        _check_version(what, data.get("version", 1))
        if data.get("outcome", "ok") != "ok":
            raise ProtocolError(f"{what}: outcome {data['outcome']!r} carries no measurement")
        return cls._parse(data, what, ("outcome", "rank"))
