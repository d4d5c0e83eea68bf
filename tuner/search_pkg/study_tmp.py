"""The Optuna study: its name and storage, the search space, seeding, constraints, ask/tell.

One study per recipe and hardware, kept in the recipe's storage, so a session that stops (Ctrl-C,
a crash, a finished ``n_trials``) resumes where it was, and several ``recompute-tune`` processes
against one storage share the work. The parent process owns every trial: it asks Optuna for a
candidate (`TuningStudy.ask`), decides whether to run it (a duplicate of a policy already
measured is not; one the planner predicts far over budget is not), and tells Optuna what
happened (`tell_result`, `tell_skipped`, `tell_duplicate`, `tell_interrupted`). Everything a
session later reports (the trials table, the best feasible trial, the baselines) is read back
from the trials' user attributes, so it covers every worker that shared the study.

The search space depends on the model: where every layer is alike (one class, same parameter
shapes), which layer gets which mode matters much less than *how many* do, so the space is a
count of layers per mode plus a placement (first / last / spread) from which the per-layer policy
is built deterministically. Where layers differ, each layer gets its own categorical choice.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState

from lightning_recompute.errors import RecomputeError
from lightning_recompute.layers import find_layers
from lightning_recompute.policy import Mode, RecomputePolicy
from tuner.units import format_bytes

try:
    import fcntl
except ImportError:  # not POSIX: stores open unlocked; the session retries a failed open
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from tuner.recipe import Recipe
    from tuner.trial import TrialResult

__all__ = [
    "BASELINES",
    "CONSTRAINT",
    "FAR_OVER_BUDGET",
    "PLACEMENTS",
    "LayerInfo",
    "Prediction",
    "Predictor",
    "Proposal",
    "SearchSpace",
    "Seed",
    "TrialRecord",
    "TuningStudy",
    "baseline_seeds",
    "far_over_budget",
    "inspect_layers",
    "open_storage",
    "peak_constraint",
    "sqlite_setup_lock",
    "study_name",
]

_log = logging.getLogger(__name__)

PLACEMENTS = ("first", "last", "spread")
"""Where a grouped space puts the layers of each mode: at the front, at the back, or evenly spaced."""

FAR_OVER_BUDGET = 1.25
"""A candidate the planner predicts above this multiple of the budget is recorded as skipped, not run.
Below it, the prediction's error (the planner is a model) could still hide a policy that fits."""

# Memory saved per layer, weakest first: the mode left on the layers no count claims ("fill") is the
# weakest mode searched, and placement hands out positions to the strongest first.
_STRENGTH = (Mode.NONE.value, Mode.SELECTIVE.value, Mode.OFFLOAD.value, Mode.FULL.value)

# Trial user attributes (the study's own record of each trial; see `TrialRecord`).
_A_OUTCOME = "outcome"
_A_KEY = "candidate_key"
_A_SEED = "seed"
_A_SEED_KEY = "seed_key"
_A_PEAK_OVER = "peak_minus_budget"
_SEEDED = "seeded"  # study user attribute: seeding happened once, by the first session
_ABANDONED = "setup_abandoned"  # study user attribute: the creator was stopped before seeding


# ---------------------------------------------------------------------------------------------- naming, storage


def study_name(recipe: Recipe, device: str) -> str:
    """The study of ``recipe`` on ``device``: the recipe's ``study.name``, or name + hardware + fingerprint.

    The recipe fingerprint is part of the derived name because it covers what a trial measures
    (model, data, budget, modes): two recipes that differ there must not share trials, while one
    whose ``n_trials`` grew continues its study.
    """
    if recipe.study.name:
        return recipe.study.name
    hardware = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "unknown-device"
    return f"{recipe.name}.{hardware}.{recipe.fingerprint()[:8]}"


@contextlib.contextmanager
def sqlite_setup_lock(url: str) -> Iterator[None]:
    """Hold an exclusive lock beside a ``sqlite:///`` database while a store opens it; a no-op otherwise.

    Opening a new SQLite store creates or migrates its tables (Optuna's and MLflow's both do), and
    two workers doing that at once fail on each other's half-made schema. Once made, opening is
    a plain read, so the lock is only held for the opening.
    """
    if not url.startswith("sqlite:///") or fcntl is None:
        yield
        return
    path = Path(url[len("sqlite:///") :]).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """Optuna storage for a database URL, or a journal file for a path ending in ``.log``.

    SQLite gets a long lock timeout: several workers on one file wait for each other's writes
    instead of failing with "database is locked".
    """
    if "://" not in url:
        if not url.endswith(".log"):
            raise RecomputeError(
                f"study.storage: {url!r} is neither a database URL nor a journal file "
                f"(valid: sqlite:///optuna.db, postgresql://..., or a path ending in .log)"
            )
        path = Path(url).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))
    if url.startswith("sqlite:///"):
        with sqlite_setup_lock(url):
            return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 120}})
    return optuna.storages.RDBStorage(url)


CONSTRAINT = "peak_minus_budget"
"""The Optuna constraint of every told trial (``Trial.set_constraint``): peak minus the budget limit."""


def peak_constraint(trial: FrozenTrial) -> tuple[float]:
    """The trial's memory constraint: measured (or, for a skipped trial, predicted) peak minus the budget.

    Positive means infeasible, so Optuna never reports an over-budget trial as the best one. A
    trial without a figure is infeasible too: a policy whose memory is unknown cannot be promised
    to fit.
    """
    value = trial.constraints.get(CONSTRAINT, trial.user_attrs.get(_A_PEAK_OVER))
    return (float(value) if value is not None else math.inf,)


# ---------------------------------------------------------------------------------------------- layers, space


@dataclass(frozen=True)
class LayerInfo:
    """One layer the policy decides: its module path and what makes it alike or unlike the others."""

    name: str
    """Module path, as `lightning_recompute.find_layers` names it."""
    kind: str
    """Class and parameter shapes, hashed: layers of equal kind cost the same to keep or recompute."""


def inspect_layers(recipe: Recipe) -> list[LayerInfo]:
    """The recipe's layers and their kinds, from a model built on the meta device (no memory).

    A model that cannot be built on the meta device (it loads weights, or calls ``.item()`` in
    ``__init__``) is built on the CPU instead.

    Raises:
        RecomputeError: the model cannot be built, or the recipe's ``layers`` match nothing.
    """
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
    """What the study samples, and how its parameters become a policy and a micro-batch size.

    ``grouped`` spaces have the parameters ``n_<mode>`` (how many layers take each mode other than
    the fill mode) and ``placement``; per-layer spaces have one ``layer.<path>`` parameter per layer.
    Both have ``micro_batch`` when several sizes are searched.
    """

    layer_names: tuple[str, ...]
    """The layers, in model order."""
    modes: tuple[str, ...]
    """The modes a layer may take (the recipe's ``search.modes``)."""
    grouped: bool
    """Whether the space is counts + placement (alike layers) rather than one choice per layer."""
    micro_batches: tuple[int, ...] | None = None
    """Micro-batch sizes searched; ``None`` keeps the data module's own."""

    def __post_init__(self) -> None:
        if not self.layer_names:
            raise RecomputeError("layers: the model has no layers to decide a policy for")
        unknown = [m for m in self.modes if m not in _STRENGTH]
        if unknown or not self.modes:
            raise RecomputeError(f"search.modes: {list(self.modes)} (valid: one or more of {', '.join(_STRENGTH)})")

    @classmethod
    def for_layers(
        cls, layers: Sequence[LayerInfo], modes: Sequence[str], micro_batches: Sequence[int] | None = None
    ) -> SearchSpace:
        """Grouped when there are several layers and all are of one kind; per-layer otherwise."""
        alike = len(layers) > 1 and len({layer.kind for layer in layers}) == 1
        return cls(
            layer_names=tuple(layer.name for layer in layers),
            modes=tuple(dict.fromkeys(modes)),
            grouped=alike,
            micro_batches=tuple(micro_batches) if micro_batches else None,
        )

    # -------------------------------------------------------------- structure

    @property
    def fill_mode(self) -> str:
        """The mode of layers no count claims: ``none`` when searched, else the weakest mode searched."""
        return min(self.modes, key=_STRENGTH.index)

    @property
    def counted_modes(self) -> tuple[str, ...]:
        """Modes with an ``n_<mode>`` parameter, strongest first (the order placement hands out layers)."""
        return tuple(sorted((m for m in self.modes if m != self.fill_mode), key=_STRENGTH.index, reverse=True))

    @property
    def kind(self) -> str:
        """``grouped`` or ``per-layer``."""
        return "grouped" if self.grouped else "per-layer"

    def describe(self) -> str:
        """One line for logs, e.g. ``grouped: n_full, n_selective in 0..4, placement (first/last/spread)``."""
        mb = (
            f"; micro_batch in {list(self.micro_batches)}" if self.micro_batches and len(self.micro_batches) > 1 else ""
        )
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
        if self.micro_batches and len(self.micro_batches) > 1:
            dists["micro_batch"] = CategoricalDistribution(self.micro_batches)
        return dists

    def signature(self) -> dict[str, Any]:
        """What a study created for this space records, to refuse resuming it with another space."""
        return {
            "kind": self.kind,
            "layers": list(self.layer_names),
            "modes": list(self.modes),
            "micro_batches": list(self.micro_batches or ()),
        }

    # -------------------------------------------------------------- params <-> policy

    def policy(self, modes: Mapping[str, str]) -> RecomputePolicy:
        """The canonical policy of a per-layer mode map: one explicit entry per layer, in model order.

        Every policy the tuner builds goes through here, so equal decisions have equal fingerprints.
        """
        return RecomputePolicy.from_modes({name: str(modes[name]) for name in self.layer_names})

    def micro_batch(self, params: Mapping[str, Any]) -> int | None:
        """The micro-batch size a parameter set asks for (``None``: the data module's own)."""
        if not self.micro_batches:
            return None
        return int(params.get("micro_batch", self.micro_batches[0]))

    def modes_of(self, params: Mapping[str, Any]) -> dict[str, str]:
        """The per-layer modes a parameter set stands for (deterministic)."""
        names = self.layer_names
        if not self.grouped:
            return {n: str(params[f"layer.{n}"]) for n in names}
        out = [self.fill_mode] * len(names)
        placement = str(params.get("placement", "first"))
        if placement not in PLACEMENTS:
            raise RecomputeError(f"placement: {placement!r} (valid: {', '.join(PLACEMENTS)})")
        free = list(range(len(names)))
        if placement == "last":
            free.reverse()
        for mode in self.counted_modes:
            # Counts past the layers left are clipped: the strongest mode claims layers first.
            n = min(int(params.get(f"n_{mode}", 0)), len(free))
            picked = _spread(free, n) if placement == "spread" else free[:n]
            for i in picked:
                out[i] = mode
            taken = set(picked)
            free = [i for i in free if i not in taken]
        return dict(zip(names, out))

    def decode(self, params: Mapping[str, Any]) -> tuple[RecomputePolicy, int | None]:
        """The policy and micro-batch size of a parameter set."""
        return self.policy(self.modes_of(params)), self.micro_batch(params)

    def encode(self, modes: Mapping[str, str], micro_batch: int | None = None) -> dict[str, Any] | None:
        """Parameters that `decode` to exactly ``modes`` (and ``micro_batch``); ``None`` if the space has none.

        A grouped space cannot express every arrangement (e.g. ``F.sF``); the caller decides what
        to do with such a policy (see `nearest`).
        """
        if set(modes) != set(self.layer_names) or any(str(m) not in self.modes for m in modes.values()):
            return None
        params: dict[str, Any] = {}
        if self.micro_batches and len(self.micro_batches) > 1:
            mb = self.micro_batches[0] if micro_batch is None else int(micro_batch)
            if mb not in self.micro_batches:
                return None
            params["micro_batch"] = mb
        elif micro_batch is not None and self.micro_batches and int(micro_batch) != self.micro_batches[0]:
            return None
        want = {n: str(modes[n]) for n in self.layer_names}
        if not self.grouped:
            return {**{f"layer.{n}": want[n] for n in self.layer_names}, **params}
        counts = {f"n_{m}": sum(1 for v in want.values() if v == m) for m in self.counted_modes}
        if not self.counted_modes:
            return params
        for placement in PLACEMENTS:
            candidate = {**counts, "placement": placement, **params}
            if self.modes_of(candidate) == want:
                return candidate
        return None

    def nearest(self, modes: Mapping[str, str], micro_batch: int | None = None) -> dict[str, Any] | None:
        """`encode`, or in a grouped space the same per-mode counts placed first.

        Alike layers cost alike, so a planner's choice is mostly in its counts; keeping those
        keeps its predicted memory and time, whatever the arrangement.
        """
        exact = self.encode(modes, micro_batch)
        if exact is not None or not self.grouped:
            return exact
        if set(modes) != set(self.layer_names) or any(str(m) not in self.modes for m in modes.values()):
            return None
        counts = {f"n_{m}": sum(1 for v in modes.values() if str(v) == m) for m in self.counted_modes}
        params = {**counts, "placement": "first"}
        if self.micro_batches and len(self.micro_batches) > 1:
            mb = self.micro_batches[0] if micro_batch is None else int(micro_batch)
            if mb not in self.micro_batches:
                return None
            params["micro_batch"] = mb
        return params


def _spread(free: Sequence[int], n: int) -> list[int]:
    """``n`` of the ``free`` positions, evenly spaced from the first.

    The stride is ceil(len/n), so half the layers are exactly every 2nd layer (torchtitan's
    "every k-th block" choice is in the space); when that stride would run past the end, even
    fractional spacing is used instead.
    """
    m = len(free)
    if n <= 0:
        return []
    if n >= m:
        return list(free)
    k = -(-m // n)
    idx = [i * k for i in range(n)] if (n - 1) * k < m else [(i * m) // n for i in range(n)]
    return [free[i] for i in idx]


# ---------------------------------------------------------------------------------------------- seeds


@dataclass(frozen=True)
class Seed:
    """A candidate enqueued before sampling starts: a baseline or a planner suggestion."""

    name: str
    """``baseline:full``, ``planner:budget`` ...: how the table and MLflow label it."""
    modes: Mapping[str, str]
    """Per-layer modes."""
    micro_batch: int | None = None
    """Micro-batch size (``None``: the first searched, or the data module's own)."""


BASELINES = ("none", "full", "selective", "every_2nd_full")
"""The baselines every study measures (those whose modes the recipe searches)."""


def baseline_seeds(space: SearchSpace) -> list[Seed]:
    """No recompute, full on every layer, selective on every layer, full on every 2nd layer.

    A baseline whose mode the recipe does not search is left out: it could not be compared at
    the same settings.
    """
    names = space.layer_names
    mb = space.micro_batches[0] if space.micro_batches else None
    seeds = []
    for mode in ("none", "full", "selective"):
        if mode in space.modes:
            seeds.append(Seed(f"baseline:{mode}", {n: mode for n in names}, mb))
    if "full" in space.modes and "none" in space.modes and len(names) > 1:
        every = RecomputePolicy.every_kth(names, 2, "full").resolve(names)
        seeds.append(Seed("baseline:every_2nd_full", {n: m.value for n, m in every.items()}, mb))
    return seeds


# ---------------------------------------------------------------------------------------------- the study


@dataclass(frozen=True)
class Prediction:
    """The planner's figures for one candidate (either may be unknown)."""

    peak_bytes: int | None = None
    step_time_s: float | None = None

    def to_dict(self) -> dict[str, float | int]:
        """Non-null figures under the names `tuner.tracking` logs (``peak_bytes``, ``step_time_s``)."""
        return {k: v for k, v in (("peak_bytes", self.peak_bytes), ("step_time_s", self.step_time_s)) if v is not None}


@dataclass
class Proposal:
    """A trial Optuna handed out: what it stands for and what the session decides about it."""

    trial: optuna.Trial
    policy: RecomputePolicy
    micro_batch: int | None
    seed: str | None
    """The seed's name when the trial was enqueued, else ``None`` (sampled)."""
    duplicate_of: FrozenTrial | None = None
    """A trial of the same policy and micro-batch already measured, measuring, or failed."""
    prediction: Prediction | None = None

    @property
    def number(self) -> int:
        return self.trial.number

    @property
    def key(self) -> str:
        return _candidate_key(self.policy, self.micro_batch)


def _candidate_key(policy: RecomputePolicy, micro_batch: int | None) -> str:
    return f"{policy.fingerprint()}@{micro_batch if micro_batch is not None else '-'}"


@dataclass(frozen=True)
class TrialRecord:
    """One finished trial of the study, as its user attributes describe it (any worker's)."""

    number: int
    state: str
    """Optuna's state name: COMPLETE, FAIL, PRUNED (RUNNING/WAITING are not records)."""
    outcome: str
    """ok / over_budget / oom / timeout / error / skipped, or duplicate / interrupted (never measured)."""
    policy: RecomputePolicy | None
    fingerprint: str
    short: str
    micro_batch: int | None
    seed: str | None
    throughput: float | None = None
    throughput_unit: str = ""
    peak_bytes: int | None = None
    step_time_s: float | None = None
    predicted_peak_bytes: int | None = None
    predicted_step_time_s: float | None = None
    reason: str | None = None
    run_id: str | None = None
    duplicate_of: int | None = None
    feasible: bool = False
    """Measured and within the budget limit."""

    @property
    def measured(self) -> bool:
        """Whether this trial ran the policy (duplicates, skips and interruptions did not)."""
        return self.outcome in ("ok", "over_budget", "oom", "timeout", "error")

    def to_dict(self) -> dict[str, Any]:
        """Plain types for the trials table (``policy`` as the policy-file mapping)."""
        return {
            "number": self.number,
            "state": self.state,
            "outcome": self.outcome,
            "policy": None if self.policy is None else self.policy.to_dict(),
            "policy_fingerprint": self.fingerprint,
            "policy_short": self.short,
            "micro_batch": self.micro_batch,
            "seed": self.seed,
            "throughput": self.throughput,
            "throughput_unit": self.throughput_unit,
            "peak_bytes": self.peak_bytes,
            "step_time_s": self.step_time_s,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_step_time_s": self.predicted_step_time_s,
            "reason": self.reason,
            "run_id": self.run_id,
            "duplicate_of": self.duplicate_of,
            "feasible": self.feasible,
        }


class TuningStudy:
    """An Optuna study driven by ask/tell from the tuning session.

    Build one with `open`. Outcomes map to Optuna states so the sampler learns the right thing:
    a measured trial is COMPLETE with its throughput (an over-budget one too, made infeasible by
    the constraint, so TPE learns where the memory wall is); oom / timeout / error are FAIL; a
    candidate skipped on the planner's prediction is PRUNED; a re-proposal of a policy already
    measured is COMPLETE with the earlier figures (no second measurement, and the sampler is not
    misled into thinking the region bad); an interrupted trial is FAIL, and if it was a seed it is
    enqueued again for the next session.
    """

    def __init__(self, study: optuna.Study, space: SearchSpace, *, budget_bytes: int, created: bool) -> None:
        self.study = study
        self.space = space
        self.budget_bytes = int(budget_bytes)
        self.created = created
        """Whether this process created the study (and so seeds it)."""
        self._distributions = space.distributions()

    # -------------------------------------------------------------- opening, seeding

    @classmethod
    def open(
        cls,
        *,
        name: str,
        storage: str | optuna.storages.BaseStorage,
        space: SearchSpace,
        budget_bytes: int,
        seed: int = 0,
        attrs: Mapping[str, Any] | None = None,
    ) -> TuningStudy:
        """Create the study, or load it when it exists (resume; another worker).

        Only one process can create a study of a given name (Optuna refuses the second), which
        is how concurrent workers agree on who seeds it. The creator's TPE sampler is seeded with
        ``seed`` (a fresh study replays exactly); a session that loads the study draws from a
        stream of its own, derived from ``seed``, the host and the process.

        Raises:
            RecomputeError: the existing study was created for another search space or budget.
        """
        store = open_storage(storage) if isinstance(storage, str) else storage
        # Constraints are set on each trial before it is told (`_constrain`): Optuna 5 deprecates
        # TPESampler's constraints_func in favour of Trial.set_constraint, which TPE reads the same way.
        sampler = optuna.samplers.TPESampler(seed=seed)
        try:
            study = optuna.create_study(storage=store, study_name=name, direction="maximize", sampler=sampler)
            created = True
            study.set_user_attr("search_space", space.signature())
            study.set_user_attr("budget_bytes", int(budget_bytes))
            for key, value in (attrs or {}).items():
                study.set_user_attr(key, value)
        except optuna.exceptions.DuplicatedStudyError:
            # A session joining (or resuming) the study samples from its own stream: with the
            # recipe's seed, two workers looking at the same history would propose the same
            # candidates in lockstep and spend their time on duplicates.
            joined_seed = int(
                hashlib.sha256(f"{seed}:{socket.gethostname()}:{os.getpid()}".encode()).hexdigest()[:8], 16
            )
            sampler = optuna.samplers.TPESampler(seed=joined_seed)
            study = optuna.load_study(study_name=name, storage=store, sampler=sampler)
            created = False
            stored = study.user_attrs.get("search_space")
            if stored is not None and stored != space.signature():
                raise RecomputeError(
                    f"study.name: study {name!r} was created for another search space ({stored}); this recipe "
                    f"searches {space.signature()} (valid: another study.name, or the recipe that created it)"
                ) from None
            stored_budget = study.user_attrs.get("budget_bytes")
            if stored_budget is not None and int(stored_budget) != int(budget_bytes):
                raise RecomputeError(
                    f"study.name: study {name!r} was tuned for a budget limit of {stored_budget} bytes, this "
                    f"recipe's is {budget_bytes} (valid: another study.name for another budget)"
                ) from None
        return cls(study, space, budget_bytes=budget_bytes, created=created)

    def wait_seeded(self, timeout_s: float, poll_s: float = 0.5) -> bool:
        """Wait for the process that created the study to finish setting it up; whether it did.

        The creator profiles the model and seeds the study right after creating it; another worker
        started at the same moment waits for that rather than doing it twice. It stops waiting
        when the creator gave up (it was interrupted while setting up) or after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            attrs = self.study.user_attrs
            if attrs.get(_SEEDED):
                return True
            if attrs.get(_ABANDONED) or time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)

    def abandon_setup(self) -> None:
        """Say that this process stopped setting up the study, so no other worker waits for it."""
        if not self.study.user_attrs.get(_SEEDED):
            self.study.set_user_attr(_ABANDONED, True)

    def seed(self, seeds: Sequence[Seed]) -> list[str]:
        """Enqueue those of ``seeds`` the study does not hold yet, mark it seeded; the names enqueued.

        Call it once per study (the creator, or a session taking over an abandoned setup): a
        resumed session must not seed again. Seeds already present (a planner candidate equal to
        a baseline; a seed another worker enqueued) are not enqueued twice.
        """
        present = {
            t.user_attrs.get(_A_SEED_KEY) or t.user_attrs.get(_A_KEY)
            for t in self.study.get_trials(deepcopy=False)
            if t.user_attrs.get(_A_OUTCOME) != "interrupted"
        }
        enqueued = []
        for s in seeds:
            params = self.space.nearest(s.modes, s.micro_batch)
            if params is None:
                _log.info(
                    "seed %s is outside the search space (modes %s); not enqueued",
                    s.name,
                    sorted(set(s.modes.values())),
                )
                continue
            policy, mb = self.space.decode(params)
            key = _candidate_key(policy, mb)
            if key in present:
                continue  # e.g. a planner candidate equal to a baseline: measure it once
            present.add(key)
            self.study.enqueue_trial(params, user_attrs={_A_SEED: s.name, _A_SEED_KEY: key})
            enqueued.append(s.name)
        self.study.set_user_attr(_SEEDED, True)
        return enqueued

    # -------------------------------------------------------------- ask

    def ask(self) -> Proposal:
        """The next candidate (an enqueued seed first), with `Proposal.duplicate_of` filled in.

        The candidate's key (policy fingerprint and micro-batch) is written to the trial before
        the other trials are read, so of two workers proposing the same candidate at once the
        later one always sees the earlier; among trials still running, the lower number measures.
        """
        trial = self.study.ask(fixed_distributions=self._distributions)
        policy, mb = self.space.decode(trial.params)
        seed_name = trial.user_attrs.get(_A_SEED)
        proposal = Proposal(trial=trial, policy=policy, micro_batch=mb, seed=seed_name)
        key = proposal.key
        trial.set_user_attr(_A_KEY, key)
        trial.set_user_attr("policy", policy.to_dict())
        trial.set_user_attr("policy_fingerprint", policy.fingerprint())
        trial.set_user_attr("policy_short", policy.short(self.space.layer_names))
        trial.set_user_attr("micro_batch", mb)
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        proposal.duplicate_of = self._find_duplicate(key, trial.number)
        return proposal

    def _find_duplicate(self, key: str, number: int) -> FrozenTrial | None:
        finished: FrozenTrial | None = None
        for t in self.study.get_trials(deepcopy=False):
            if t.number == number or t.user_attrs.get(_A_KEY) != key:
                continue
            outcome = t.user_attrs.get(_A_OUTCOME)
            if outcome in ("duplicate", "interrupted"):
                continue  # never measured: not evidence about this candidate
            if t.state == TrialState.RUNNING:
                if t.number < number:
                    return t
                continue
            if t.state in (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED):
                # Prefer a measured trial to a skipped or failed one as the figures to reuse.
                if finished is None or (t.state == TrialState.COMPLETE and finished.state != TrialState.COMPLETE):
                    finished = t
        return finished

    # -------------------------------------------------------------- tell

    def tell_result(
        self, proposal: Proposal, result: TrialResult, *, run_id: str | None = None, reason: str | None = None
    ) -> FrozenTrial:
        """Record a trial that ran: COMPLETE with its throughput when measured, FAIL otherwise."""
        t = proposal.trial
        self._set_common(proposal, outcome=result.outcome, run_id=run_id, reason=reason or result.error)
        for key, value in (
            ("throughput", result.throughput),
            ("throughput_unit", result.throughput_unit),
            ("peak_bytes", result.peak_bytes),
            ("step_time_s", result.step_time_s),
            ("wall_s", result.wall_s),
        ):
            t.set_user_attr(key, value)
        if result.measured and result.throughput is not None:
            self._constrain(t, None if result.peak_bytes is None else result.peak_bytes - self.budget_bytes)
            return self.study.tell(t, float(result.throughput))
        return self.study.tell(t, state=TrialState.FAIL)

    def tell_skipped(self, proposal: Proposal, reason: str, *, run_id: str | None = None) -> FrozenTrial:
        """Record a candidate not run (the planner predicts it far over budget) as PRUNED, with why."""
        t = proposal.trial
        self._set_common(proposal, outcome="skipped", run_id=run_id, reason=reason)
        pred = proposal.prediction
        self._constrain(t, None if pred is None or pred.peak_bytes is None else pred.peak_bytes - self.budget_bytes)
        return self.study.tell(t, state=TrialState.PRUNED)

    def tell_duplicate(self, proposal: Proposal, *, run_id: str | None = None) -> FrozenTrial:
        """Record a re-proposal without measuring it again.

        A duplicate of a finished trial takes that trial's state and figures; one of a trial
        still running elsewhere is FAIL (its figures are not known yet, and FAIL trials are not
        what the sampler learns from).
        """
        original = proposal.duplicate_of
        if original is None:
            raise RecomputeError(f"trial {proposal.number}: not a duplicate")
        t = proposal.trial
        reason = f"same policy and micro-batch as trial {original.number}"
        self._set_common(proposal, outcome="duplicate", run_id=run_id, reason=reason)
        t.set_user_attr("duplicate_of", original.number)
        if original.state == TrialState.RUNNING:
            return self.study.tell(t, state=TrialState.FAIL)
        # Only the constraint is copied: the figures stay with the trial that measured them, so
        # the trials table and the Pareto plot show each measurement once.
        if original.state in (TrialState.COMPLETE, TrialState.PRUNED):
            self._constrain(t, original.user_attrs.get(_A_PEAK_OVER))
        if original.state == TrialState.COMPLETE and original.value is not None:
            return self.study.tell(t, float(original.value))
        return self.study.tell(t, state=original.state)

    def tell_interrupted(self, proposal: Proposal, reason: str) -> FrozenTrial:
        """Record a trial stopped by the user (FAIL); a seed goes back in the queue for the next session."""
        t = proposal.trial
        self._set_common(proposal, outcome="interrupted", run_id=None, reason=reason)
        frozen = self.study.tell(t, state=TrialState.FAIL, skip_if_finished=True)
        if proposal.seed is not None:
            self.study.enqueue_trial(dict(t.params), user_attrs={_A_SEED: proposal.seed, _A_SEED_KEY: proposal.key})
        return frozen

    @staticmethod
    def _constrain(trial: optuna.Trial, peak_over: float | None) -> None:
        # Unknown memory counts as infeasible (see `peak_constraint`); kept as a user attribute
        # too, where the trials table reads it.
        value = math.inf if peak_over is None else float(peak_over)
        trial.set_user_attr(_A_PEAK_OVER, None if peak_over is None else value)
        trial.set_constraint(CONSTRAINT, value)

    def _set_common(self, proposal: Proposal, *, outcome: str, run_id: str | None, reason: str | None) -> None:
        t = proposal.trial
        t.set_user_attr(_A_OUTCOME, outcome)
        t.set_user_attr("mlflow_run_id", run_id)
        t.set_user_attr("reason", reason)
        pred = proposal.prediction
        t.set_user_attr("predicted_peak_bytes", None if pred is None else pred.peak_bytes)
        t.set_user_attr("predicted_step_time_s", None if pred is None else pred.step_time_s)

    # -------------------------------------------------------------- reading back

    def records(self) -> list[TrialRecord]:
        """Every finished trial of the study (all workers, all sessions), in trial order."""
        out = []
        for t in self.study.get_trials(
            deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)
        ):
            a = t.user_attrs
            policy = RecomputePolicy.from_dict(a["policy"]) if a.get("policy") else None
            peak_over = a.get(_A_PEAK_OVER)
            outcome = str(a.get(_A_OUTCOME, "error"))
            out.append(
                TrialRecord(
                    number=t.number,
                    state=t.state.name,
                    outcome=outcome,
                    policy=policy,
                    fingerprint=str(a.get("policy_fingerprint", "")),
                    short=str(a.get("policy_short", "")),
                    micro_batch=a.get("micro_batch"),
                    seed=a.get(_A_SEED),
                    throughput=a.get("throughput"),
                    throughput_unit=str(a.get("throughput_unit") or ""),
                    peak_bytes=a.get("peak_bytes"),
                    step_time_s=a.get("step_time_s"),
                    predicted_peak_bytes=a.get("predicted_peak_bytes"),
                    predicted_step_time_s=a.get("predicted_step_time_s"),
                    reason=a.get("reason"),
                    run_id=a.get("mlflow_run_id"),
                    duplicate_of=a.get("duplicate_of"),
                    feasible=outcome == "ok" and peak_over is not None and float(peak_over) <= 0,
                )
            )
        return out

    def best(self) -> TrialRecord | None:
        """The measured, within-budget trial of highest throughput; ``None`` when there is none."""
        feasible = [r for r in self.records() if r.feasible and r.throughput is not None]
        return max(feasible, key=lambda r: (r.throughput, -r.number)) if feasible else None

    def measured_count(self) -> int:
        """Trials that ran a policy (what ``n_trials`` counts), all workers together."""
        return sum(1 for r in self.records() if r.measured)

    def running(self) -> list[FrozenTrial]:
        """Trials Optuna holds as running (this or another worker's)."""
        return self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))

    def waiting(self) -> list[FrozenTrial]:
        """Enqueued trials not yet handed out."""
        return self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))


Predictor = Callable[[RecomputePolicy, int | None], Prediction | None]
"""``(policy, micro_batch) -> Prediction | None``: the planner's view of a candidate, if it has one."""


def far_over_budget(prediction: Prediction | None, budget_bytes: int, factor: float = FAR_OVER_BUDGET) -> str | None:
    """Why a candidate should not be run, or ``None`` when it should."""
    if prediction is None or prediction.peak_bytes is None:
        return None
    if prediction.peak_bytes > factor * budget_bytes:
        return (
            f"planner predicts a peak of {_fmt_bytes(prediction.peak_bytes)}, more than {factor:g}x the budget "
            f"limit of {_fmt_bytes(budget_bytes)}"
        )
    return None


def _fmt_bytes(n: int) -> str:
    return f"{format_bytes(n)} ({n} bytes)" if n >= 1024 else f"{n} bytes"
