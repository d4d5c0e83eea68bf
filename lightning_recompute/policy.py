"""`RecomputePolicy`: which layers keep, recompute or offload their activations.

An ordered map from a layer path or glob to a mode; the first matching entry decides, and an unmatched
layer keeps everything. The file format is the tuner's contract with the plugin (docs/PLUGIN.md, 'The policy file').
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from lightning_recompute.atomic import atomic_write
from lightning_recompute.errors import DocumentError, PolicyError, clip
from lightning_recompute.modes import MODES, SAVE_FAMILIES, UNKNOWN_GLYPH, Mode
from lightning_recompute.safe_yaml import load_document
from lightning_recompute.tuned_for import TunedFor

__all__ = ["POLICY_VERSION", "Mode", "PolicyLike", "RecomputePolicy"]

POLICY_VERSION = 1
_TOP_LEVEL_KEYS = ("version", "layers", "selective", "compile", "tuned_for")


@dataclass(frozen=True)
class RecomputePolicy:
    """An immutable, ordered layer-pattern -> mode map, identified across processes by `fingerprint`.

    Build one with `uniform`, `every_kth`, `first_n`, `from_modes`, `from_dict` or `load`.
    """

    layers: tuple[tuple[str, Mode], ...] = ()
    """``(pattern, mode)`` pairs in priority order; a pattern is a module path or an `fnmatch` glob."""
    selective_save: tuple[str, ...] | None = None
    """Ops whose outputs ``selective`` keeps; ``None``: `DEFAULT_SAVE_OPS`."""
    families: tuple[tuple[str, str], ...] = ()
    """``(pattern, family)`` for ``layers`` entries in mode ``selective:<family>`` (`SAVE_FAMILIES`)."""
    compile: bool = False
    """Whether `apply_policy` also compiles every layer (not bitwise; see docs/PLUGIN.md)."""
    version: int = field(default=POLICY_VERSION)
    tuned_for: TunedFor | None = field(default=None, compare=False)
    """What the tuner measured the policy at; provenance only (not in ``==``, ``hash`` or `fingerprint`)."""

    def __post_init__(self) -> None:
        if self.version != POLICY_VERSION:
            raise PolicyError(
                f"version: unsupported policy version {clip(repr(self.version))}; valid: {POLICY_VERSION}"
            )
        layers = []
        families = dict(self.families)
        for i, entry in enumerate(self.layers):
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise PolicyError(f"layers[{i}]: expected a (pattern, mode) pair, got {clip(repr(entry))}")
            pattern, mode = entry
            if not isinstance(pattern, str) or not pattern.strip():
                raise PolicyError(f"layers[{i}]: a layer pattern must be a non-empty string, got {clip(repr(pattern))}")
            parsed, family = Mode.parse_choice(mode, where=f"layers.{clip(pattern)}")
            if family is not None:
                families.setdefault(pattern, family)
            layers.append((pattern, parsed))
        object.__setattr__(self, "layers", tuple(layers))
        object.__setattr__(self, "families", self._check_families(families))
        if self.selective_save is not None:
            # Imported here: selective imports torch.
            from lightning_recompute.selective import resolve_save_ops

            names = tuple(self.selective_save)
            resolve_save_ops(names, where="selective.save")  # validates; raises PolicyError
            object.__setattr__(self, "selective_save", names)
        if not isinstance(self.compile, bool):
            raise PolicyError(f"compile: must be true or false, got {clip(repr(self.compile))}")
        if self.tuned_for is not None and not isinstance(self.tuned_for, TunedFor):
            raise PolicyError(f"tuned_for: expected a TunedFor, got {type(self.tuned_for).__name__}")

    def _check_families(self, families: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        """``families`` in layer order, checked (selective entries, known names)."""
        if not families:
            return ()
        modes = dict(reversed(self.layers))  # the first entry of a pattern decides it
        for pattern in families:
            if modes.get(pattern) is not Mode.SELECTIVE:
                raise PolicyError(
                    f"layers.{clip(pattern)}: a save-list family needs mode selective, the entry's mode is "
                    f"{modes[pattern].value if pattern in modes else 'missing (no such layers entry)'}"
                )
        for pattern, family in families.items():
            if family not in SAVE_FAMILIES:
                raise PolicyError(
                    f"layers.{clip(pattern)}: unknown save-list family {clip(repr(family))}; valid families are: "
                    f"{', '.join(SAVE_FAMILIES)}"
                )
        return tuple((p, families[p]) for p, _ in self.layers if p in families and p in modes)

    @classmethod
    def uniform(cls, mode: Mode | str, pattern: str = "*", **kwargs: Any) -> RecomputePolicy:
        """Every layer (or every layer matching ``pattern``) in one mode."""
        return cls.from_modes({pattern: mode}, **kwargs)

    @classmethod
    def from_modes(cls, modes: Mapping[str, Mode | str], **kwargs: Any) -> RecomputePolicy:
        """One explicit entry per layer path, in the mapping's order (a mode may be ``selective:<family>``)."""
        layers: list[tuple[str, Mode]] = []
        families: list[tuple[str, str]] = []
        for name, m in modes.items():
            mode, family = Mode.parse_choice(m, where=f"layers.{clip(str(name))}")
            layers.append((name, mode))
            if family is not None:
                families.append((name, family))
        return cls(layers=tuple(layers), families=tuple(families), **kwargs)

    @classmethod
    def every_kth(
        cls, layer_names: Sequence[str], k: int, mode: Mode | str = Mode.FULL, *, offset: int = 0, **kwargs: Any
    ) -> RecomputePolicy:
        """``mode`` on every ``k``-th layer (``offset``, ``offset + k``, ...), ``none`` elsewhere."""
        if not isinstance(k, int) or k < 1:
            raise PolicyError(f"k: must be a positive integer, got {k!r}")
        m = Mode.parse(mode, where="mode")
        return cls.from_modes(
            {n: (m if i >= offset and (i - offset) % k == 0 else Mode.NONE) for i, n in enumerate(layer_names)},
            **kwargs,
        )

    @classmethod
    def first_n(
        cls, layer_names: Sequence[str], n: int, mode: Mode | str = Mode.FULL, **kwargs: Any
    ) -> RecomputePolicy:
        """``mode`` on the first ``n`` layers (their activations live longest), ``none`` on the rest."""
        if not isinstance(n, int) or n < 0:
            raise PolicyError(f"n: must be a non-negative integer, got {n!r}")
        m = Mode.parse(mode, where="mode")
        return cls.from_modes({name: (m if i < n else Mode.NONE) for i, name in enumerate(layer_names)}, **kwargs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "policy") -> RecomputePolicy:
        """Parse the policy-file structure; errors are prefixed with ``source`` (a file name)."""
        if not isinstance(data, Mapping):
            raise PolicyError(
                f"{source}: a policy must be a mapping with keys {list(_TOP_LEVEL_KEYS)}, got {type(data).__name__}"
            )
        unknown = [k for k in data if k not in _TOP_LEVEL_KEYS]
        if unknown:
            raise PolicyError(f"{source}: unknown key(s) {clip(repr(unknown))}; valid keys are {list(_TOP_LEVEL_KEYS)}")
        if "version" not in data:
            raise PolicyError(f"{source}: missing key 'version'; valid: version: {POLICY_VERSION}")
        version = data["version"]
        if version != POLICY_VERSION:
            raise PolicyError(
                f"{source}: key 'version': unsupported policy version {clip(repr(version))}; valid: {POLICY_VERSION}"
            )
        raw_layers = data.get("layers") or {}
        if not isinstance(raw_layers, Mapping):
            raise PolicyError(
                f"{source}: key 'layers' must map layer paths or globs to modes, got {type(raw_layers).__name__}"
            )
        layers: list[tuple[str, Mode]] = []
        families: list[tuple[str, str]] = []
        for pattern, mode in raw_layers.items():
            try:
                parsed, family = Mode.parse_choice(mode, where=f"layers.{clip(str(pattern))}")
            except PolicyError as err:
                raise PolicyError(f"{source}: {err}") from None
            layers.append((str(pattern), parsed))
            if family is not None:
                families.append((str(pattern), family))
        selective, save = data.get("selective"), None
        if selective is not None:
            if not isinstance(selective, Mapping) or set(selective) - {"save"}:
                raise PolicyError(
                    f"{source}: key 'selective' must be a mapping with the single key 'save' (a list of op names)"
                )
            save = selective.get("save")
            if save is not None and (isinstance(save, str) or not isinstance(save, Iterable)):
                raise PolicyError(
                    f"{source}: key 'selective.save' must be a list of op names such as aten.mm, got {clip(repr(save))}"
                )
        compile_layers = data.get("compile", False)
        if not isinstance(compile_layers, bool):
            raise PolicyError(f"{source}: key 'compile' must be true or false, got {clip(repr(compile_layers))}")
        raw_tuned = data.get("tuned_for")
        tuned = None if raw_tuned is None else TunedFor.from_dict(raw_tuned, source=source)
        try:
            return cls(
                layers=tuple(layers),
                selective_save=None if save is None else tuple(str(s) for s in save),
                families=tuple(families),
                compile=compile_layers,
                tuned_for=tuned,
            )
        except PolicyError as err:
            raise PolicyError(f"{source}: {err}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RecomputePolicy:
        """Read a policy file (JSON for ``.json``, else YAML) within `lightning_recompute.safe_yaml`'s bounds."""
        p = Path(path)
        try:
            data = load_document(p, what="policy file")
        except DocumentError as err:
            raise PolicyError(str(err)) from None
        if data is None:
            raise PolicyError(f"{p}: policy file is empty; expected keys {list(_TOP_LEVEL_KEYS)}")
        return cls.from_dict(data, source=str(p))

    def to_dict(self) -> dict[str, Any]:
        """The policy-file structure (plain types only); ``tuned_for`` only when the policy has it."""
        out = self._behaviour_dict()
        if self.tuned_for is not None:
            out["tuned_for"] = self.tuned_for.to_dict()
        return out

    def _behaviour_dict(self) -> dict[str, Any]:
        """What the policy does to a model: the file structure without ``tuned_for``."""
        families = dict(self.families)
        out: dict[str, Any] = {
            "version": self.version,
            "layers": {p: _choice(m, families.get(p)) for p, m in self.layers},
        }
        if self.selective_save is not None:
            out["selective"] = {"save": list(self.selective_save)}
        if self.compile:
            out["compile"] = True  # absent when false: older files keep their fingerprint
        return out

    def with_tuned_for(self, tuned_for: TunedFor | None) -> RecomputePolicy:
        """The same policy, recording ``tuned_for`` (``None`` drops the record)."""
        return replace(self, tuned_for=tuned_for)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the policy to ``path`` (JSON for ``.json``, else YAML), atomically."""
        p = Path(path)
        return atomic_write(p, self.to_json() if p.suffix.lower() == ".json" else self.to_yaml())

    def fingerprint(self) -> str:
        """A short, stable identifier of what the policy does (order-sensitive, format-independent).

        ``tuned_for`` is left out, so the same modes tuned elsewhere, and files written before it existed, match.
        """
        canonical = json.dumps(self._behaviour_dict(), sort_keys=False, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def mode_for(self, layer: str) -> Mode:
        """The mode of one layer path (first matching pattern; ``none`` when none matches)."""
        for pattern, mode in self.layers:
            if _matches(pattern, layer):
                return mode
        return Mode.NONE

    def family_for(self, layer: str) -> str | None:
        """The save-list family of one layer path (``None``: not selective, or ``selective_save``'s list)."""
        for pattern, _ in self.layers:
            if _matches(pattern, layer):
                return dict(self.families).get(pattern)
        return None

    def choice_for(self, layer: str) -> str:
        """The mode of one layer path as the file writes it: ``full``, ``selective``, ``selective:attn``, ..."""
        return _choice(self.mode_for(layer), self.family_for(layer))

    def resolve_choices(self, layer_names: Sequence[str], *, source: str = "policy") -> dict[str, str]:
        """`resolve`, with each mode written as `choice_for` writes it (family included)."""
        self.resolve(layer_names, source=source)
        return {name: self.choice_for(name) for name in layer_names}

    def resolve(self, layer_names: Sequence[str], *, source: str = "policy") -> dict[str, Mode]:
        """The mode of every layer; a `PolicyError` if some pattern matches no layer (likely a typo)."""
        unmatched = [p for p, _ in self.layers if not any(_matches(p, n) for n in layer_names)]
        if unmatched:
            shown = _summarise(layer_names)
            raise PolicyError(
                f"{source}: layer pattern(s) {clip(repr(unmatched))} match no layer of the model; "
                f"the layers are: {shown}"
            )
        return {name: self.mode_for(name) for name in layer_names}

    def describe(self, layer_names: Sequence[str] | None = None) -> str:
        """A readable table: per pattern, or per layer when ``layer_names`` is given."""
        if layer_names is None:
            families = dict(self.families)
            rows = [(p, _choice(m, families.get(p))) for p, m in self.layers] or [("*", "none (no entries)")]
            header = ("pattern", "mode")
        else:
            rows = [(n, self.choice_for(n)) for n in layer_names]
            header = ("layer", "mode")
        width = max(len(header[0]), *(len(r[0]) for r in rows))
        lines = [f"{header[0]:<{width}}  {header[1]}", f"{'-' * width}  {'-' * 9}"]
        lines += [f"{a:<{width}}  {b}" for a, b in rows]
        save = "default" if self.selective_save is None else ", ".join(self.selective_save)
        lines.append(
            f"policy {self.fingerprint()}; selective saves: {save}{'; layers compiled' if self.compile else ''}"
        )
        if self.tuned_for is not None:
            lines.append(self.tuned_for.describe())
        return "\n".join(lines)

    def short(self, layer_names: Sequence[str]) -> str:
        """One character per layer (see `glyph`), for logs."""
        return "".join(glyph(self.choice_for(n)) for n in layer_names)


_GLYPHS = {s.name: s.glyph for s in MODES}


def glyph(choice: str) -> str:
    """One character for a layer's mode as `RecomputePolicy.choice_for` writes it (``?`` if it has none)."""
    return _GLYPHS.get(choice, UNKNOWN_GLYPH)


def _choice(mode: Mode, family: str | None) -> str:
    return mode.value if family is None else f"{mode.value}:{family}"


PolicyLike = RecomputePolicy | Mapping[str, Any] | str | os.PathLike
"""A policy object, the file structure, a path, or ``"mlflow:<experiment>[@<tracking uri>]"``."""


def _matches(pattern: str, name: str) -> bool:
    return pattern == name or fnmatch.fnmatchcase(name, pattern)


def _summarise(names: Sequence[str], limit: int = 12) -> str:
    if not names:
        return "(none)"
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[: limit // 2]) + f", ... ({len(names) - limit} more) ..., " + ", ".join(names[-limit // 2 :])
