"""``plan``, ``history`` and ``rollback``: each returns a summary the CLI prints (``--format json``: its `to_dict`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_recompute.errors import RecomputeError
from lightning_recompute.units import jsonable
from tuner.exits import EXIT_INFEASIBLE, EXIT_OK, Declined
from tuner.recipe._schema import Component, accepts, positive_arg

if TYPE_CHECKING:
    from lightning_recompute.planner import PlannedPolicy
    from lightning_recompute.planner.seqlen import SeqLenFit
    from lightning_recompute.profile import Profile
    from tuner._tracking import Decision, GoodPolicy, Tracker
    from tuner.recipe import Recipe


def _row(p: PlannedPolicy | None) -> dict[str, Any]:
    keys = ("policy", "short", "peak_bytes", "step_time_s", "micro_batch")
    if p is None:
        return dict.fromkeys(keys)
    return dict(
        zip(keys, (p.policy.to_dict(), p.short(), p.peak_bytes, p.step_time_s, p.prediction.micro_batch), strict=True)
    )


@dataclass
class PlanSummary:
    """The predicted front (by increasing peak) and the fastest policy within the budget (else ``reason``)."""

    recipe: str
    device: str
    budget_bytes: int
    layer_names: tuple[str, ...]
    front: list[PlannedPolicy]
    profile: Profile
    chosen: PlannedPolicy | None = None
    reason: str | None = None
    written: Path | None = None
    exit_code: int = EXIT_OK
    sharding: str | None = None  # "per rank, world size 64, fsdp" for one rank of several

    def to_dict(self) -> dict[str, Any]:
        """Plain types (JSON-ready); the profile is left out."""
        skip = ("profile", "front", "chosen")
        out = {f.name: jsonable(getattr(self, f.name)) for f in fields(self) if f.name not in skip}
        return {**out, "front": [_row(p) for p in self.front], "chosen": self.chosen and _row(self.chosen)}


def plan(
    recipe: Recipe,
    *,
    budget: str | int | None = None,
    write: str | Path | None = None,
    meta: str | None = None,
    world_size: int | None = None,
    strategy: str | None = None,
) -> PlanSummary:
    """Profile the recipe's model (measured, or on the meta device for ``meta``, a `HARDWARE` key), per rank of
    ``world_size`` under ``strategy``, and plan it for ``budget``; ``write`` the chosen policy there."""
    from lightning_recompute.planner import BudgetError, Planner
    from lightning_recompute.planner.sharding import shard_profile, sharding_for
    from tuner._preflight import output_problem
    from tuner.recipe._profile import recipe_layout

    sharding = sharding_for(recipe, world_size, strategy)  # problems found before profiling, which takes minutes
    mb, device, limit, profile_of = _target(recipe, budget, meta)
    if write is not None:
        problem = output_problem(Path(write).expanduser().absolute(), key="--write")
        if problem is not None:
            raise RecomputeError(problem)
    profile = profile_of(recipe)
    if sharding is not None:
        profile = shard_profile(profile, recipe_layout(recipe, profile.layer_names), sharding)
    planner = Planner(profile)
    modes = list(recipe.search.modes)
    summary = PlanSummary(
        recipe=recipe.name,
        device=device,
        budget_bytes=limit,
        layer_names=tuple(profile.layer_names),
        front=planner.pareto_front(modes, micro_batch=mb),
        profile=profile,
        sharding=None if sharding is None else sharding.describe(),
    )
    try:
        summary.chosen = planner.solve(limit, modes=modes, micro_batch=mb)
    except BudgetError as err:
        summary.reason = str(err)
        summary.exit_code = EXIT_INFEASIBLE
        return summary
    if write is not None:
        try:
            summary.written = summary.chosen.policy.save(write)
        except OSError as err:  # the folder changed since the check
            raise RecomputeError(f"--write: cannot write {write}: {err.strerror or err}") from None
    return summary


def _target(
    recipe: Recipe, budget: str | int | None, meta: str | None
) -> tuple[int | None, str, int, Callable[[Recipe], Profile]]:
    """The micro-batch planned for, the device (in words), the budget limit in bytes (``--budget``, else the
    recipe's) and how to profile a recipe there."""
    from lightning_recompute.profile import HARDWARE
    from lightning_recompute.units import parse_bytes
    from tuner._trials import device_info, profile_recipe
    from tuner.recipe._profile import profile_recipe_meta

    mb = recipe.search.micro_batch_sizes[0] if recipe.search.micro_batch_sizes else None
    total: int | None
    if meta is not None:
        if meta not in HARDWARE:
            raise RecomputeError(f"--meta: unknown hardware {meta!r}; valid: {', '.join(HARDWARE)}")
        device, total = f"{HARDWARE[meta].name} (estimated on the meta device)", HARDWARE[meta].memory_bytes
    else:
        device, total = device_info(recipe)

    def profile_of(variant: Recipe) -> Profile:
        return profile_recipe_meta(variant, mb, meta) if meta is not None else profile_recipe(variant, mb)

    try:
        limit = recipe.budget.limit_bytes(total) if budget is None else parse_bytes(budget)
    except ValueError as err:
        raise RecomputeError(f"--budget: {err}") from None
    return mb, device, limit, profile_of


@dataclass
class SeqLenSummary:
    """Per policy family, the longest ``seq_arg`` (set on the components ``set_on``) that fits."""

    recipe: str
    device: str
    budget_bytes: int
    micro_batch: int
    seq_arg: str
    set_on: tuple[str, ...]
    step: int
    cap: int
    fits: list[SeqLenFit]
    profiles: int
    exit_code: int = EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: jsonable(getattr(self, f.name)) for f in fields(self) if f.name != "fits"}
        keys = ("family", "seq_len", "capped", "tokens_per_s")
        out["fits"] = [{**{k: getattr(f, k) for k in keys}, **_row(f.plan)} for f in self.fits]
        return out


def with_seq_len(recipe: Recipe, seq_arg: str, length: int) -> tuple[Recipe, tuple[str, ...]]:
    """``recipe`` with ``seq_arg=length`` in the init args of its model and data where their constructors take
    it, and which took it (``model``, ``data``); a `RecomputeError` when neither does."""
    changes: dict[str, Component] = {
        key: Component(c.class_path, {**c.init_args, seq_arg: length})
        for key, c in (("model", recipe.model), ("data", recipe.data))
        if accepts(c.import_class(), seq_arg)
    }
    if not changes:
        raise RecomputeError(
            f"--seq-arg: neither model {recipe.model.class_path} nor data {recipe.data.class_path} takes an argument "
            f"named {seq_arg!r}; name the constructor argument that sets the sequence length with --seq-arg NAME"
        )
    model, data = changes.get("model", recipe.model), changes.get("data", recipe.data)
    return dataclasses.replace(recipe, model=model, data=data), tuple(changes)


def max_seq_len(
    recipe: Recipe,
    *,
    budget: str | int | None = None,
    meta: str | None = None,
    seq_arg: str = "seq_len",
    step: int = 64,
    cap: int = 2**20,
) -> SeqLenSummary:
    """Per policy family (each searched mode on every layer, and the planner's best mix), the longest sequence
    length that fits the budget, every probed length profiled and planned."""
    from lightning_recompute.planner.seqlen import longest_fits

    mb, device, limit, profile_of = _target(recipe, budget, meta)
    _, set_on = with_seq_len(recipe, seq_arg, 1)  # fails now, before any profiling, if nothing takes it
    batches: dict[int, int] = {}

    def profile_at(length: int) -> Profile:
        try:
            prof = profile_of(with_seq_len(recipe, seq_arg, length)[0])
        except RecomputeError:
            raise
        except Exception as err:  # the user's model refusing a length (e.g. beyond its position table)
            raise RecomputeError(f"profiling at {seq_arg}={length} failed: {type(err).__name__}: {err}") from err
        same = [other for other, size in batches.items() if size == prof.batch_bytes]
        if same:
            raise RecomputeError(
                f"--seq-arg: the batch is {prof.batch_bytes} bytes at both {seq_arg}={same[0]} and {seq_arg}={length}: "
                f"{seq_arg} (set on {', '.join(set_on)}) does not change the sequence length of the batch"
            )
        batches[length] = prof.batch_bytes
        return prof

    start = positive_arg(recipe.data, seq_arg) or positive_arg(recipe.model, seq_arg) or step
    fits = longest_fits(profile_at, limit, modes=list(recipe.search.modes), start=start, step=step, cap=cap)
    micro_batch = next((f.plan.prediction.micro_batch for f in fits if f.plan is not None), mb or 0)
    return SeqLenSummary(
        recipe=recipe.name,
        device=device,
        budget_bytes=limit,
        micro_batch=micro_batch,
        seq_arg=seq_arg,
        set_on=set_on,
        step=step,
        cap=cap,
        fits=fits,
        profiles=len(batches),
        exit_code=EXIT_OK if any(f.seq_len is not None for f in fits) else EXIT_INFEASIBLE,
    )


@dataclass
class HistorySummary:
    """Every decision, oldest first, and the good policy now (or why it cannot be read); ``missing``: the SQLite
    tracking database that does not exist yet."""

    experiment: str
    tracking_uri: str
    decisions: list[Decision]
    current: GoodPolicy | None = None
    missing: Path | None = None
    current_problem: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: jsonable(getattr(self, f.name)) for f in fields(self)}


def history(recipe: Recipe) -> HistorySummary:
    """Every decision recorded for ``recipe``'s experiment, from MLflow alone; reading creates nothing."""
    tracker = _tracker(recipe)
    summary = HistorySummary(str(recipe.tracking.experiment), recipe.tracking.uri, [])
    if isinstance(tracker, Path):
        summary.missing = tracker
        return summary
    from tuner._tracking import TrackingError

    summary.decisions = tracker.registry.history()
    try:
        summary.current = tracker.registry.current_good()
    except TrackingError as err:  # an edited artifact must not hide the record of decisions
        summary.current_problem = str(err)
    return summary


@dataclass(frozen=True)
class RollbackSummary:
    """The good policy now, whether it moved back, what was repaired or cleaned up, its peak against the budget."""

    good: GoodPolicy
    rolled_back: bool
    file_note: str | None
    cleaned: tuple[str, ...] = ()
    budget_note: str | None = None


def rollback(recipe: Recipe, *, allow_over_budget: bool = False) -> RollbackSummary:
    """Restore the previous good policy (MLflow record and ``recipe.output``) after making the file match the
    current one; an earlier policy over the budget now is `Declined` unless ``allow_over_budget``."""
    from tuner._liveness import grace_s

    tracker = _tracker(recipe)
    if isinstance(tracker, Path):
        raise Declined(
            f"nothing to roll back to: there is no tracking database at {tracker} (tracking.uri); "
            f"nothing has been tuned with this recipe there yet"
        )
    registry = tracker.registry
    cleaned = registry.clean_leftovers(recipe.output, grace_s())
    note = registry.restore_file(recipe.output)
    current = registry.current_good()
    if note is not None and current is not None and not registry.can_roll_back():
        return RollbackSummary(good=current, rolled_back=False, file_note=note, cleaned=cleaned)
    budget_note: str | None = None

    def vet(candidate: GoodPolicy) -> None:
        nonlocal budget_note
        budget_note, over = _against_budget(recipe, candidate)
        if over and not allow_over_budget:
            raise Declined(
                f"rollback refused: {budget_note}; nothing was changed. Training with it would likely run out of "
                f"memory. Raise budget in {recipe.source or 'the recipe'} if it is meant to fit, or pass "
                f"--allow-over-budget to restore it anyway"
            )

    restored = registry.rollback(output_path=recipe.output, vet=vet)
    return RollbackSummary(restored, rolled_back=True, file_note=note, cleaned=cleaned, budget_note=budget_note)


def _against_budget(recipe: Recipe, good: GoodPolicy) -> tuple[str, bool]:
    """How ``good``'s measured peak compares with ``recipe``'s budget limit now, in words, and whether it is over."""
    from lightning_recompute.units import format_bytes
    from tuner._trials import device_info

    tuned = good.policy.tuned_for
    peak = good.peak_bytes if good.peak_bytes is not None else (tuned.peak_bytes if tuned is not None else None)
    what = f"run {good.run_id} ({good.fingerprint})"
    if peak is None:
        return f"{what} has no measured peak on record, so it is not checked against the budget", False
    total = device_info(recipe)[1] if recipe.budget.is_fraction else None
    limit = recipe.budget.limit_bytes(total)
    if peak > limit:
        return (
            f"{what} peaked at {format_bytes(peak)} when measured, over the recipe's budget limit "
            f"{format_bytes(limit)} ({recipe.budget.describe(total)})"
        ), True
    return f"{what} peaked at {format_bytes(peak)}, within the budget limit {format_bytes(limit)}", False


def _tracker(recipe: Recipe) -> Tracker | Path:
    """The recipe's `Tracker` for a command that reads or restores, or its ``sqlite:///`` database that does
    not exist (opening one would create it); never creates the experiment (a misspelt one is a `SettingsError`)."""
    from tuner._preflight import SettingsError, tracking_problem

    uri = recipe.tracking.uri
    problem = tracking_problem(uri)
    if problem is not None:
        raise SettingsError([problem])
    path = Path(uri[len("sqlite:///") :]).expanduser()
    if uri.startswith("sqlite:///") and not uri.endswith(":memory:") and not path.exists():
        return path
    from tuner._tracking import ExperimentNotFound, Tracker

    try:
        return Tracker(uri, str(recipe.tracking.experiment), create=False)
    except ExperimentNotFound as err:
        raise SettingsError([str(err)]) from None
