"""The parent/child protocol of the trial worker: one typed spec per kind of measurement, as JSON.

The parent (`tuner._trials.runner`) builds a spec, writes its `Spec.to_dict` as ``SPEC.json`` and
runs ``python -m tuner._trials.worker SPEC.json RESULT.json``; the child (`tuner._trials.worker`)
reads it back with `parse_spec`. The kinds, all listed in `SPEC_TYPES`:

- ``trial`` (`TrialSpec`): a real Lightning ``Trainer`` with `RecomputeCallback` runs warm-up plus
  measured steps; the result holds every step's time, peak memory, samples and tokens.
- ``numerics`` (`NumericsSpec`): loss, gradients, every parameter and buffer and the eval-mode loss of
  one training step with and without the policy, in deterministic mode, against the spread of two runs
  without it (`NumericsPayload`).
- ``device`` (`DeviceSpec`): the name and total memory of the device an accelerator selects.
- ``profile`` (`ProfileSpec`): the recipe's per-layer cost profile (`tuner.recipe._profile`).
- ``race`` (`RaceSpec`): several policies measured in turn on one model in one fit (`lightning_recompute.race.engine`).

The ``RANKED_KINDS`` run on the recipe's ``trainer.devices`` ranks (`Spec.ranks`), each rank
writing its own result (`rank_result_path`) that the parent merges.

Every spec and `NumericsPayload` carry the protocol ``version``: a child given a version or a kind it
does not know fails with a `ProtocolError` naming it and what it supports. A mapping without a
``version`` is version 1 (the keys a spec had before the field existed). Recipes and policies travel
as their own ``to_dict`` forms and are built in the child: this module imports the standard library
only, so the child parses its spec without spending its deadline on imports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

__all__ = [
    "KINDS",
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


class ProtocolError(ValueError):
    """A spec or result the other side cannot read: unknown version or kind, a missing, unknown or mistyped key."""


_S = TypeVar("_S", bound="Spec")


def _check_version(what: str, version: Any) -> int:
    if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
        raise ProtocolError(
            f"{what}: protocol version {version!r} is not supported; this worker reads version(s) "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}"
        )
    return int(version)


def _fields_of(cls: type, data: Mapping[str, Any], what: str, envelope: frozenset[str]) -> dict[str, Any]:
    """``data``'s values for ``cls``'s fields, converted by their annotations; unknown or missing keys are errors."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields) - envelope)
    if unknown:
        raise ProtocolError(f"{what}: unknown key(s) {unknown}; valid: {sorted(fields)}")
    missing = sorted(
        name
        for name, f in fields.items()
        if name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    if missing:
        raise ProtocolError(f"{what}: missing key(s) {missing}")
    values = {}
    for name in fields.keys() & data.keys():
        convert = _CONVERT[str(fields[name].type)]
        try:
            values[name] = convert(data[name])
        except (TypeError, ValueError, AttributeError, ProtocolError) as err:
            raise ProtocolError(f"{what}: {name} = {data[name]!r:.80}: {err}") from err
    return values


def _optional(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else convert(value)


def _mapping(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"expected a mapping, got {type(value).__name__}")
    return dict(value)


def _strings(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(f"expected a list of strings, got {type(value).__name__}")
    return tuple(str(v) for v in value)


def _plain(value: Any) -> Any:
    """JSON-ready: tuples as lists, nested dataclasses as their ``to_dict``."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    to_dict = getattr(value, "to_dict", None)
    return to_dict() if callable(to_dict) else value


@dataclass(frozen=True, kw_only=True)
class Spec:
    """What every spec carries. A concrete kind names itself in ``kind`` and is listed in `SPEC_TYPES`."""

    kind: ClassVar[str] = ""
    ranked: ClassVar[bool] = False
    """Whether the kind runs on the recipe's ``trainer.devices`` ranks (`RANKED_KINDS`)."""

    version: int = PROTOCOL_VERSION
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
        """Plain types only (JSON-ready), ``kind`` included."""
        return {"kind": self.kind, **{f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}}

    @classmethod
    def from_dict(cls: type[_S], data: Mapping[str, Any]) -> _S:
        """The inverse of `to_dict`. ``kind`` may be left out; a missing ``version`` is version 1.

        Raises:
            ProtocolError: an unsupported version, another kind, unknown or missing keys, a value of the wrong type.
        """
        what = f"{cls.kind} spec"
        _check_version(what, data.get("version", 1))
        if data.get("kind", cls.kind) != cls.kind:
            raise ProtocolError(f"{what}: kind is {data['kind']!r}")
        return cls(**_fields_of(cls, data, what, frozenset({"kind"})))

    @classmethod
    def of(cls: type[_S], spec: Spec | Mapping[str, Any]) -> _S:
        """``spec`` itself if it is one of these, else parsed from its mapping form (`from_dict`)."""
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, Spec):
            raise ProtocolError(f"expected a {cls.kind} spec, got a {spec.kind} spec")
        return cls.from_dict(spec)


@dataclass(frozen=True, kw_only=True)
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
        if not self.ranked:
            return 1
        return int(self.recipe.get("trainer", {}).get("devices", 1))


@dataclass(frozen=True, kw_only=True)
class TrialSpec(_RecipeSpec):
    """Warm-up plus measured training steps of the recipe's model under a policy."""

    kind: ClassVar[str] = "trial"
    ranked: ClassVar[bool] = True
    policy: dict[str, Any]
    """`lightning_recompute.RecomputePolicy.to_dict`."""
    warmup_steps: int
    measure_steps: int


@dataclass(frozen=True, kw_only=True)
class NumericsSpec(_RecipeSpec):
    """One training step's loss, gradients and state under a policy against two runs without it."""

    kind: ClassVar[str] = "numerics"
    ranked: ClassVar[bool] = True
    policy: dict[str, Any]
    """`lightning_recompute.RecomputePolicy.to_dict`."""


@dataclass(frozen=True, kw_only=True)
class ProfileSpec(_RecipeSpec):
    """The recipe's per-layer cost profile, each layer measured ``repeats`` times."""

    kind: ClassVar[str] = "profile"
    repeats: int


@dataclass(frozen=True)
class RaceEntrant:
    """One policy in a race: its key (the policy's fingerprint), the policy, and its glyphs."""

    key: str
    policy: dict[str, Any]
    """`lightning_recompute.RecomputePolicy.to_dict`."""
    short: str

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "policy": self.policy, "short": self.short}

    @classmethod
    def from_dict(cls, data: Any) -> RaceEntrant:
        return cls(**_fields_of(cls, _mapping(data), "race entrant", frozenset()))


def _entrants(value: Any) -> tuple[RaceEntrant, ...]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"expected a list of entrants, got {type(value).__name__}")
    return tuple(RaceEntrant.from_dict(e) for e in value)


@dataclass(frozen=True, kw_only=True)
class RaceSpec(_RecipeSpec):
    """Several policies raced in turn on one model in one fit."""

    kind: ClassVar[str] = "race"
    entrants: tuple[RaceEntrant, ...]
    references: tuple[str, ...] = ()
    """Keys of the entrants the winner's "vs" figures are about."""
    budget_bytes: int | None = None
    """An entrant peaking over it is out of the race."""
    plan: dict[str, Any] = dataclasses.field(default_factory=dict)
    """`lightning_recompute.race.RacePlan.to_dict`."""


@dataclass(frozen=True, kw_only=True)
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
    """The spec a parent wrote (`Spec.to_dict`), as its kind's class.

    Raises:
        ProtocolError: not a mapping, an unsupported version, an unknown kind, or a malformed spec of its kind.
    """
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


# ---------------------------------------------------------------------------------------------- results


@dataclass(frozen=True, kw_only=True)
class NumericsPayload:
    """A ``numerics`` worker's measurement (its result's ``outcome`` is ``ok``)."""

    version: int = PROTOCOL_VERSION
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
        return {"outcome": "ok", **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NumericsPayload:
        """The inverse of `to_dict`; the result's ``outcome`` and ``rank`` are read past, a missing ``version`` is 1.

        Raises:
            ProtocolError: an unsupported version, an outcome other than ``ok``, unknown or missing keys.
        """
        what = "numerics result"
        _check_version(what, data.get("version", 1))
        if data.get("outcome", "ok") != "ok":
            raise ProtocolError(f"{what}: outcome {data['outcome']!r} carries no measurement")
        return cls(**_fields_of(cls, data, what, frozenset({"outcome", "rank"})))


_CONVERT: dict[str, Callable[[Any], Any]] = {
    "int": int,
    "float": float,
    "bool": bool,
    "str": str,
    "int | None": _optional(int),
    "float | None": _optional(float),
    "str | None": _optional(str),
    "dict[str, Any]": _mapping,
    "tuple[str, ...]": _strings,
    "tuple[RaceEntrant, ...]": _entrants,
}
"""How a JSON value becomes a field's value, by the field's annotation (every annotation used above)."""
