"""The search space: the recipe's layers and what makes them alike, how the study's parameters become a policy
and a micro-batch size (counts + placement for alike layers, one choice per layer otherwise), and the seeds."""

from __future__ import annotations

import enum
import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution

from lightning_recompute.errors import RecomputeError
from lightning_recompute.layers import find_layers
from lightning_recompute.modes import BY_MEMORY_SAVED
from lightning_recompute.policy import RecomputePolicy

if TYPE_CHECKING:
    from tuner.recipe import Recipe


_log = logging.getLogger(__name__)

PLACEMENTS = ("first", "last", "spread")
"""Where a grouped space puts the layers of each mode: at the front, at the back, or evenly spaced."""


@dataclass(frozen=True)
class LayerInfo:
    """One layer the policy decides: its module path and what makes it alike or unlike the others."""

    name: str  # module path, as `lightning_recompute.find_layers` names it
    kind: str  # class and parameter shapes, hashed: layers of equal kind cost the same


def inspect_layers(recipe: Recipe) -> list[LayerInfo]:
    """The recipe's layers and their kinds, from a model built on the meta device (on the CPU if that fails)."""
    import torch

    from tuner.recipe import build_model

    try:
        with torch.device("meta"):
            model = build_model(recipe)
    except RecomputeError:
        raise
    except Exception as meta_err:  # noqa: BLE001 - user code; retried on the CPU where it may work
        _log.info("building the model on the meta device failed (%s); building it on the CPU", meta_err)
        try:
            model = build_model(recipe)
        except RecomputeError:
            raise
        except Exception as err:
            raise RecomputeError(
                f"model: building {recipe.model.class_path} failed: {type(err).__name__}: {err}"
            ) from err
    infos = []
    for path, module in find_layers(model, recipe.layers):
        shapes = ";".join(f"{n}:{tuple(p.shape)}" for n, p in module.named_parameters())
        cls = type(module)
        raw = f"{cls.__module__}.{cls.__qualname__}|{shapes}"
        infos.append(LayerInfo(path, hashlib.sha256(raw.encode()).hexdigest()[:12]))
    return infos


@dataclass(frozen=True)
class SearchSpace:
    """``grouped``: ``n_<mode>`` per mode but the fill mode, and ``placement``; else ``layer.<path>`` per layer."""

    layer_names: tuple[str, ...]  # in model order
    modes: tuple[str, ...]  # the recipe's search.modes
    grouped: bool
    micro_batches: tuple[int, ...] | None = None  # None keeps the data module's own
    compile_choices: tuple[bool, ...] = (False,)  # the recipe's search.compile

    def __post_init__(self) -> None:
        # The layers come from the model, which the recipe's schema never sees; the modes from any caller.
        if not self.layer_names:
            raise RecomputeError("layers: the model has no layers to decide a policy for")
        if not self.modes or any(m not in BY_MEMORY_SAVED for m in self.modes):
            raise RecomputeError(
                f"search.modes: {list(self.modes)} (valid: one or more of {', '.join(BY_MEMORY_SAVED)})"
            )

    @classmethod
    def for_layers(
        cls,
        layers: Sequence[LayerInfo],
        modes: Sequence[str],
        micro_batches: Sequence[int] | None = None,
        compile_choices: Sequence[bool] = (False,),
    ) -> SearchSpace:
        """Grouped when there are several layers and all are of one kind; per-layer otherwise."""
        alike = len(layers) > 1 and len({layer.kind for layer in layers}) == 1
        return cls(
            layer_names=tuple(layer.name for layer in layers),
            modes=tuple(dict.fromkeys(modes)),
            grouped=alike,
            micro_batches=tuple(micro_batches) if micro_batches else None,
            compile_choices=tuple(dict.fromkeys(bool(c) for c in compile_choices)) or (False,),
        )

    @property
    def compile_searched(self) -> bool:
        return len(self.compile_choices) > 1

    @property
    def fill_mode(self) -> str:
        """The mode of layers no count claims: ``none`` when searched, else the weakest mode searched."""
        return min(self.modes, key=BY_MEMORY_SAVED.index)

    @property
    def counted_modes(self) -> tuple[str, ...]:
        """Modes with an ``n_<mode>`` parameter, strongest first (the order placement hands out layers)."""
        return tuple(sorted((m for m in self.modes if m != self.fill_mode), key=BY_MEMORY_SAVED.index, reverse=True))

    @property
    def micro_batch_searched(self) -> bool:
        return len(self.micro_batches or ()) > 1

    def describe(self) -> str:
        """One line for logs, e.g. ``grouped: n_full, n_selective in 0..4, placement (first/last/spread)``."""
        mb = f"; micro_batch in {list(self.micro_batches or ())}" if self.micro_batch_searched else ""
        if self.compile_searched:
            mb += "; compile in [false, true]"
        elif self.compile_choices[0]:
            mb += "; layers compiled"
        if self.grouped:
            counts = ", ".join(f"n_{m}" for m in self.counted_modes)
            if not counts:
                return f"grouped: every layer {self.fill_mode}{mb}"
            return f"grouped: {counts} in 0..{len(self.layer_names)}, placement ({'/'.join(PLACEMENTS)}){mb}"
        return f"per-layer: {len(self.layer_names)} x {{{', '.join(self.modes)}}}{mb}"

    def distributions(self) -> dict[str, BaseDistribution]:
        """The parameters and their distributions (fixed for the study's life, which TPE needs)."""
        dists: dict[str, BaseDistribution] = {}
        if self.grouped:
            for mode in self.counted_modes:
                dists[f"n_{mode}"] = IntDistribution(0, len(self.layer_names))
            if self.counted_modes:
                dists["placement"] = CategoricalDistribution(PLACEMENTS)
        else:
            for name in self.layer_names:
                dists[f"layer.{name}"] = CategoricalDistribution(self.modes)
        if self.micro_batches and self.micro_batch_searched:
            dists["micro_batch"] = CategoricalDistribution(self.micro_batches)
        if self.compile_searched:
            dists["compile"] = CategoricalDistribution(self.compile_choices)
        return dists

    def signature(self) -> dict[str, Any]:
        """What a study created for this space records, to refuse resuming it with another space."""
        out: dict[str, Any] = {
            "kind": "grouped" if self.grouped else "per-layer",
            "layers": list(self.layer_names),
            "modes": list(self.modes),
            "micro_batches": list(self.micro_batches or ()),
        }
        if self.compile_choices != (False,):
            # Only when compile is in play: a study created before the dimension existed still joins.
            out["compile"] = list(self.compile_choices)
        return out

    def policy(self, modes: Mapping[str, str], compile_layers: bool = False) -> RecomputePolicy:
        """Every policy the tuner builds goes through here, so equal decisions have equal fingerprints."""
        return RecomputePolicy.from_modes({name: str(modes[name]) for name in self.layer_names}, compile=compile_layers)

    def modes_of(self, params: Mapping[str, Any]) -> dict[str, str]:
        names = self.layer_names
        if not self.grouped:
            return {n: str(params[f"layer.{n}"]) for n in names}
        out = [self.fill_mode] * len(names)
        placement = str(params.get("placement", "first"))
        if placement not in PLACEMENTS:  # params read back from a stored study
            raise RecomputeError(f"placement: {placement!r} (valid: {', '.join(PLACEMENTS)})")
        free = list(range(len(names)))[:: -1 if placement == "last" else 1]
        for mode in self.counted_modes:
            # Counts past the layers left are clipped: the strongest mode claims layers first.
            n = min(int(params.get(f"n_{mode}", 0)), len(free))
            picked = _spread(free, n) if placement == "spread" else free[:n]
            for i in picked:
                out[i] = mode
            free = [i for i in free if i not in picked]
        return dict(zip(names, out, strict=False))

    def decode(self, params: Mapping[str, Any]) -> tuple[RecomputePolicy, int | None]:
        compiles = bool(params.get("compile", self.compile_choices[0]))
        mb = int(params.get("micro_batch", self.micro_batches[0])) if self.micro_batches else None
        return self.policy(self.modes_of(params), compiles), mb

    def encode(
        self, modes: Mapping[str, str], micro_batch: int | None = None, compile_layers: bool | None = None
    ) -> dict[str, Any] | None:
        """Parameters that `decode` to exactly ``modes``; ``None`` if none do (a grouped space lacks some)."""
        params = self._fixed(modes, micro_batch, compile_layers)
        sizes = self.micro_batches or ()
        if params is None or (micro_batch is not None and len(sizes) == 1 and int(micro_batch) != sizes[0]):
            return None
        if not self.grouped:
            return {**{f"layer.{n}": str(modes[n]) for n in self.layer_names}, **params}
        if not self.counted_modes:
            return params
        want = {n: str(modes[n]) for n in self.layer_names}
        candidates = ({**self._counts(modes), "placement": p, **params} for p in PLACEMENTS)
        return next((c for c in candidates if self.modes_of(c) == want), None)

    def nearest(
        self, modes: Mapping[str, str], micro_batch: int | None = None, compile_layers: bool | None = None
    ) -> dict[str, Any] | None:
        """`encode`, or in a grouped space the same per-mode counts placed first: alike layers cost alike, so
        keeping a planner's counts keeps its predicted memory and time."""
        exact = self.encode(modes, micro_batch, compile_layers)
        params = self._fixed(modes, micro_batch, compile_layers)
        if exact is not None or not self.grouped or params is None:
            return exact
        return {**self._counts(modes), "placement": "first", **params}

    def _counts(self, modes: Mapping[str, str]) -> dict[str, int]:
        return {f"n_{m}": sum(1 for v in modes.values() if str(v) == m) for m in self.counted_modes}

    def _fixed(
        self, modes: Mapping[str, str], micro_batch: int | None, compile_layers: bool | None
    ) -> dict[str, Any] | None:
        """The ``compile`` and ``micro_batch`` parameters of a candidate; ``None`` when it is outside the space."""
        compile_layers = self.compile_choices[0] if compile_layers is None else compile_layers
        if set(modes) != set(self.layer_names) or any(str(m) not in self.modes for m in modes.values()):
            return None
        if compile_layers not in self.compile_choices:
            return None
        params: dict[str, Any] = {"compile": compile_layers} if self.compile_searched else {}
        if self.micro_batches and self.micro_batch_searched:
            params["micro_batch"] = self.micro_batches[0] if micro_batch is None else int(micro_batch)
            if params["micro_batch"] not in self.micro_batches:
                return None
        return params


def _spread(free: Sequence[int], n: int) -> list[int]:
    """``n`` of the ``free`` positions, evenly spaced from the first: a stride of ceil(len/n), so half the layers
    are every 2nd layer, or even fractional spacing when that stride would run past the end."""
    m = len(free)
    if n <= 0:
        return []
    if n >= m:
        return list(free)
    k = -(-m // n)
    idx = [i * k for i in range(n)] if (n - 1) * k < m else [(i * m) // n for i in range(n)]
    return [free[i] for i in idx]


class Source(str, enum.Enum):
    """Where a trial's policy came from, as its label (``baseline:full``, ``planner:front2``; the trial's
    ``seed`` attribute) says; `of` reads it, in this one place."""

    BASELINE = "baseline"
    PLANNER = "planner"
    SEARCH = "search"  # sampled (no label)

    @classmethod
    def of(cls, label: str | None) -> Source:
        kind = (label or "").partition(":")[0]
        return cls(kind) if kind in (cls.BASELINE.value, cls.PLANNER.value) else cls.SEARCH


def pick_of(label: str | None) -> str:
    """What a label names within its source: ``full`` of ``baseline:full``, ``budget`` of ``planner:budget``."""
    return (label or "").partition(":")[2]


@dataclass(frozen=True)
class Seed:
    name: str  # baseline:full, planner:budget ...: how the table and MLflow label it
    modes: Mapping[str, str]
    micro_batch: int | None = None  # None: the first searched, or the data module's own
    compile: bool | None = None  # None: the first choice of search.compile


def baseline_seeds(space: SearchSpace) -> list[Seed]:
    """No recompute, full, selective, full on every 2nd layer: those whose modes the recipe searches."""
    names = space.layer_names
    mb = space.micro_batches[0] if space.micro_batches else None
    seeds = [
        Seed(f"baseline:{m}", dict.fromkeys(names, m), mb) for m in ("none", "full", "selective") if m in space.modes
    ]
    if "full" in space.modes and "none" in space.modes and len(names) > 1:
        every = RecomputePolicy.every_kth(names, 2, "full").resolve(names)
        seeds.append(Seed("baseline:every_2nd_full", {n: m.value for n, m in every.items()}, mb))
    return seeds
