"""`RecomputePolicy`: an ordered map from a layer path or glob to a mode (the first match decides; an unmatched
layer keeps everything), and its file, the tuner's contract with the plugin (docs/PLUGIN.md, 'The policy file').
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

POLICY_VERSION = 1
_TOP_LEVEL_KEYS = ("version", "layers", "selective", "compile", "tuned_for")


@dataclass(frozen=True)
class RecomputePolicy:
    """An immutable, ordered layer-pattern -> mode map, identified across processes by `fingerprint`."""

    # (pattern, mode) in priority order, a pattern a module path or glob; a mode given as selective:<family>
    # has its family moved to `families`.
    layers: tuple[tuple[str, Mode], ...] = ()
    selective_save: tuple[str, ...] | None = None  # what selective keeps; None: DEFAULT_SAVE_OPS
    families: tuple[tuple[str, str], ...] = ()
    compile: bool = False  # compile every layer too (not bitwise)
    version: int = field(default=POLICY_VERSION)
    tuned_for: TunedFor | None = field(default=None, compare=False)  # provenance only: not in ==, hash, fingerprint

    def __post_init__(self) -> None:
        if self.version != POLICY_VERSION:
            raise PolicyError(
                f"key 'version': unsupported policy version {clip(repr(self.version))}; valid: {POLICY_VERSION}"
            )
        given = dict(self.families)  # the first entry of a pattern takes its family
        layers: list[tuple[str, Mode]] = []
        families: dict[str, str] = {}
        choice: Any  # a Mode, or the name of one
        for i, entry in enumerate(self.layers):
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise PolicyError(f"layers[{i}]: expected a (pattern, mode) pair, got {clip(repr(entry))}")
            pattern, choice = entry
            if not isinstance(pattern, str) or not pattern.strip():
                raise PolicyError(f"layers[{i}]: a layer pattern must be a non-empty string, got {clip(repr(pattern))}")
            if pattern in given:
                choice = f"{Mode.parse(choice, where=f'layers.{clip(pattern)}').value}:{given.pop(pattern)}"
            mode, family = _parse_choice(choice, where=f"layers.{clip(pattern)}")
            if family is not None:
                families.setdefault(pattern, family)
            layers.append((pattern, mode))
        if given:
            raise PolicyError(f"families: {clip(repr(list(given)))} name no layers entry")
        object.__setattr__(self, "layers", tuple(layers))
        object.__setattr__(self, "families", tuple(families.items()))
        if self.selective_save is not None:
            from lightning_recompute.selective import resolve_save_ops  # imports torch

            save = self.selective_save
            if isinstance(save, str) or not isinstance(save, Iterable):
                raise PolicyError(
                    f"key 'selective.save' must be a list of op names such as aten.mm, got {clip(repr(save))}"
                )
            object.__setattr__(self, "selective_save", tuple(str(s) for s in save))
            resolve_save_ops(self.selective_save)  # raises PolicyError
        if not isinstance(self.compile, bool):
            raise PolicyError(f"key 'compile' must be true or false, got {clip(repr(self.compile))}")
        if self.tuned_for is not None and not isinstance(self.tuned_for, TunedFor):
            raise PolicyError(f"tuned_for: expected a TunedFor, got {type(self.tuned_for).__name__}")

    @classmethod
    def uniform(cls, mode: Mode | str, pattern: str = "*", **kwargs: Any) -> RecomputePolicy:
        """Every layer (or every layer matching ``pattern``) in one mode."""
        return cls.from_modes({pattern: mode}, **kwargs)

    @classmethod
    def from_modes(cls, modes: Mapping[str, Mode | str], **kwargs: Any) -> RecomputePolicy:
        """One explicit entry per layer path, in the mapping's order (a mode may be ``selective:<family>``)."""
        layers: Any = tuple(modes.items())  # parsed by __post_init__
        return cls(layers=layers, **kwargs)

    @classmethod
    def every_kth(
        cls, layer_names: Sequence[str], k: int, mode: Mode | str = Mode.FULL, *, offset: int = 0, **kwargs: Any
    ) -> RecomputePolicy:
        """``mode`` on every ``k``-th layer (``offset``, ``offset + k``, ...), ``none`` elsewhere."""
        if not isinstance(k, int) or k < 1:
            raise PolicyError(f"k: must be a positive integer, got {k!r}")
        mode = Mode.parse(mode, where="mode")  # named as the argument, and checked with no layers too
        picked = {n for i, n in enumerate(layer_names) if i >= offset and (i - offset) % k == 0}
        return cls.from_modes({n: mode if n in picked else Mode.NONE for n in layer_names}, **kwargs)

    @classmethod
    def first_n(
        cls, layer_names: Sequence[str], n: int, mode: Mode | str = Mode.FULL, **kwargs: Any
    ) -> RecomputePolicy:
        """``mode`` on the first ``n`` layers (their activations live longest), ``none`` on the rest."""
        if not isinstance(n, int) or n < 0:
            raise PolicyError(f"n: must be a non-negative integer, got {n!r}")
        mode = Mode.parse(mode, where="mode")
        return cls.from_modes({name: mode if i < n else Mode.NONE for i, name in enumerate(layer_names)}, **kwargs)

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
        raw_layers = data.get("layers") or {}
        if not isinstance(raw_layers, Mapping):
            raise PolicyError(
                f"{source}: key 'layers' must map layer paths or globs to modes, got {type(raw_layers).__name__}"
            )
        selective = {} if data.get("selective") is None else data["selective"]
        if not isinstance(selective, Mapping) or set(selective) - {"save"}:
            raise PolicyError(
                f"{source}: key 'selective' must be a mapping with the single key 'save' (a list of op names)"
            )
        layers: Any = tuple((str(p), m) for p, m in raw_layers.items())  # parsed by __post_init__
        try:
            raw_tuned = data.get("tuned_for")
            return cls(
                layers=layers,
                selective_save=selective.get("save"),
                compile=data.get("compile", False),
                version=data["version"],
                tuned_for=None if raw_tuned is None else TunedFor.from_dict(raw_tuned),
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
        return atomic_write(path, self.to_json() if Path(path).suffix.lower() == ".json" else self.to_yaml())

    def fingerprint(self) -> str:
        """A short, stable identifier of what the policy does (order-sensitive; ``tuned_for`` left out)."""
        canonical = json.dumps(self._behaviour_dict(), separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def mode_for(self, layer: str) -> Mode:
        """The mode of one layer path (first matching pattern; ``none`` when none matches)."""
        return next((m for p, m in self.layers if _matches(p, layer)), Mode.NONE)

    def family_for(self, layer: str) -> str | None:
        """The save-list family of one layer path (``None``: not selective, or ``selective_save``'s list)."""
        families = dict(self.families)
        return next((families.get(p) for p, _ in self.layers if _matches(p, layer)), None)

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
            shown = list(layer_names)
            if len(shown) > 12:
                shown[6:-6] = [f"... ({len(shown) - 12} more) ..."]
            raise PolicyError(
                f"{source}: layer pattern(s) {clip(repr(unmatched))} match no layer of the model; "
                f"the layers are: {', '.join(shown) or '(none)'}"
            )
        return {name: self.mode_for(name) for name in layer_names}

    def describe(self, layer_names: Sequence[str] | None = None) -> str:
        """A readable table: per pattern, or per layer when ``layer_names`` is given."""
        if layer_names is None:
            rows = list(self._behaviour_dict()["layers"].items()) or [("*", "none (no entries)")]
        else:
            rows = [(n, self.choice_for(n)) for n in layer_names]
        header = "pattern" if layer_names is None else "layer"
        width = max(len(header), *(len(r[0]) for r in rows))
        lines = [f"{header:<{width}}  mode", f"{'-' * width}  {'-' * 9}", *(f"{a:<{width}}  {b}" for a, b in rows)]
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


PolicyLike = RecomputePolicy | Mapping[str, Any] | str | os.PathLike
"""A policy object, the file structure, a path, or ``"mlflow:<experiment>[@<tracking uri>]"``."""


def _parse_choice(value: Any, *, where: str) -> tuple[Mode, str | None]:
    """A layer's mode and save-list family from ``"selective:<family>"`` or a plain mode (family ``None``)."""
    if not (isinstance(value, str) and ":" in value):
        return Mode.parse(value, where=where), None
    base, _, family = value.strip().partition(":")
    if Mode.parse(base, where=where) is not Mode.SELECTIVE or not family.strip():
        raise PolicyError(
            f"{where}: {clip(repr(value))}: only selective takes a save-list family, written "
            f"selective:<family> (e.g. selective:attn)"
        )
    if family.strip() not in SAVE_FAMILIES:
        raise PolicyError(
            f"{where}: unknown save-list family {clip(repr(family.strip()))}; valid families are: "
            f"{', '.join(SAVE_FAMILIES)}"
        )
    return Mode.SELECTIVE, family.strip()


def _choice(mode: Mode, family: str | None) -> str:
    return mode.value if family is None else f"{mode.value}:{family}"


def _matches(pattern: str, name: str) -> bool:
    return pattern == name or fnmatch.fnmatchcase(name, pattern)
