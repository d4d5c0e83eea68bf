"""The evidence gate: a search winner becomes the good policy only after it proves itself again.

A short trial can win by luck (a quiet moment on a shared host, a peak that the next allocator
state exceeds) and a policy can be subtly wrong (a recomputation that changes numerics). Before
the output policy file changes, the candidate must pass three checks, in this order (cheapest
verdict first; the first failure ends the gate, and later checks are reported as not run):

1. **confirmation**: one run at least `GateSettings.confirm_factor` (3) times as many measured
   steps as a search trial, which must end ``ok`` and peak under the budget limit (the budget
   less its margin);
2. **numerics**: on a fixed batch, loss and every gradient equal training without recompute
   (`tuner.trials.check_numerics`: deterministic mode; at the largest micro-batch up to the
   candidate's where no recompute fits; bitwise, or on an accelerator within the spread of two
   runs without recompute);
3. **regression**: candidate and current good policy re-measured side by side, interleaved
   (``C G G C`` for two rounds, so a drift in the machine's speed hits both equally); the
   candidate's median throughput must reach the good policy's median less a noise tolerance
   (2% by default: run-to-run noise of short CPU and GPU trials, not a real regression). A
   current good policy that does not fit the budget limit (its recorded peak, or its peak now, is
   over it: the budget was tightened) is no contender: the candidate replaces it.

`evaluate` decides; `decide` also records the confirmation run and the promotion or rejection
through a `tuner.tracking.Tracker`. The trial runner and numerics checker are injectable so the
gate can be tested without subprocesses; by default they are `tuner.trials.run_trial` and
`tuner.trials.check_numerics`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_recompute.errors import RecomputeError
from lightning_recompute.policy import RecomputePolicy
from lightning_recompute.tuned_for import TunedFor
from tuner.jsonable import jsonable
from tuner.units import format_bytes

if TYPE_CHECKING:
    from tuner.recipe import Recipe
    from tuner.tracking import GoodPolicy, Tracker
    from tuner.trials import NumericsResult, TrialResult

__all__ = ["Candidate", "GateDecision", "GateSettings", "decide", "evaluate", "tuned_for"]

RunTrial = Callable[..., "TrialResult"]
"""``run_trial(recipe, policy, *, micro_batch, warmup_steps, measure_steps, timeout_s, budget_bytes)``."""
CheckNumerics = Callable[..., "NumericsResult"]
"""``check_numerics(recipe, policy, *, micro_batch, timeout_s) -> NumericsResult``."""
Progress = Callable[[str], None]
"""Told one line before each check runs (the CLI prints it)."""


@dataclass(frozen=True)
class Candidate:
    """The policy the search proposes for promotion."""

    policy: RecomputePolicy
    """The policy to promote."""
    micro_batch: int | None = None
    """The micro-batch it won with (``None``: the data module's own)."""
    source_run_id: str | None = None
    """The MLflow trial run it won in, if any."""
    layer_names: tuple[str, ...] | None = None
    """The model's layers, for per-layer params of the confirmation run (``None``: the policy's patterns)."""


@dataclass(frozen=True)
class GateSettings:
    """How much evidence the gate asks for."""

    confirm_factor: int = 3
    """The confirmation run measures this many times a trial's ``measure_steps`` (at least 3)."""
    rounds: int = 2
    """Side-by-side rounds; each runs the candidate and the current good policy once."""
    tolerance: float = 0.02
    """The candidate passes when its median throughput >= good median * (1 - tolerance)."""

    def __post_init__(self) -> None:
        if not isinstance(self.confirm_factor, int) or self.confirm_factor < 3:
            raise RecomputeError(f"gate.confirm_factor: {self.confirm_factor!r}; valid: an integer >= 3")
        if not isinstance(self.rounds, int) or self.rounds < 1:
            raise RecomputeError(f"gate.rounds: {self.rounds!r}; valid: an integer >= 1")
        if not 0.0 <= self.tolerance < 0.5:
            raise RecomputeError(f"gate.tolerance: {self.tolerance!r}; valid: a fraction in [0, 0.5)")


@dataclass
class GateDecision:
    """What the gate concluded, and on what evidence."""

    promoted: bool
    """Whether the candidate passed every check."""
    reasons: list[str]
    """When promoted: one line per passed check. Otherwise: why it failed (first the failed check)."""
    evidence: dict[str, Any]
    """Everything measured, JSON-ready: ``confirmation``, ``numerics``, ``regression``, ``settings``."""
    unchanged: bool = False
    """The candidate is already the current good policy: nothing was run, nothing is to be recorded."""
    confirmation: TrialResult | None = None
    """The confirmation run's `TrialResult` (``None`` when the gate did not get that far)."""
    decision_run_id: str | None = None
    """The MLflow decision run (`decide` fills it in)."""
    confirmation_run_id: str | None = None
    """The MLflow confirmation run (`decide` fills it in)."""
    checks: dict[str, str] = field(default_factory=dict)
    """Check name -> ``passed`` / ``failed`` / ``not run``."""

    @property
    def reason(self) -> str:
        """The reasons as one line."""
        return "; ".join(self.reasons)


def evaluate(
    candidate: Candidate | RecomputePolicy,
    current_good: GoodPolicy | None,
    *,
    recipe: Recipe,
    budget_bytes: int | None,
    run_trial: RunTrial | None = None,
    check_numerics: CheckNumerics | None = None,
    settings: GateSettings | None = None,
    progress: Progress | None = None,
) -> GateDecision:
    """Run the three checks on ``candidate`` against ``current_good``; touches no file and no record.

    Args:
        candidate: the proposed policy (a bare policy means the data module's micro-batch).
        current_good: the good policy now (`Tracker.current_good`), or ``None`` before the first.
        recipe: the recipe (its ``trial`` settings give the trial length and timeout).
        budget_bytes: the memory limit after the margin (``recipe.budget.limit_bytes(...)``);
            ``None`` checks no budget.
        run_trial: the trial runner; default `tuner.trials.run_trial`.
        check_numerics: the numerics checker; default `tuner.trials.check_numerics`.
        settings: `GateSettings` (defaults: 3x steps, 2 rounds, 2% tolerance).
        progress: told a line before each check that runs (nothing for an unchanged candidate).
    """
    cand = candidate if isinstance(candidate, Candidate) else Candidate(policy=candidate)
    if not isinstance(cand.policy, RecomputePolicy):
        raise RecomputeError(f"candidate.policy: expected a RecomputePolicy, got {type(cand.policy).__name__}")
    cfg = settings or GateSettings()
    tell = progress or (lambda _line: None)
    if run_trial is None or check_numerics is None:
        # Imported late: tuner.trials spawns subprocesses and imports the recipe machinery, which
        # callers injecting their own runners (tests, other schedulers) do not need.
        from tuner import trials

        run_trial = run_trial or trials.run_trial
        check_numerics = check_numerics or trials.check_numerics

    warmup = int(recipe.trial.warmup_steps)
    steps = int(recipe.trial.measure_steps)
    timeout = float(recipe.trial.timeout_s)
    evidence: dict[str, Any] = {
        "candidate": {
            "fingerprint": cand.policy.fingerprint(),
            "micro_batch": cand.micro_batch,
            "source_run_id": cand.source_run_id,
            "policy": cand.policy.to_dict(),
        },
        "current_good": None
        if current_good is None
        else {
            "run_id": current_good.run_id,
            "fingerprint": current_good.fingerprint,
            "micro_batch": current_good.micro_batch,
            "throughput": current_good.throughput,
            "peak_bytes": current_good.peak_bytes,
        },
        "budget_bytes": budget_bytes,
        "settings": {"confirm_factor": cfg.confirm_factor, "rounds": cfg.rounds, "tolerance": cfg.tolerance},
    }
    decision = GateDecision(
        promoted=False,
        reasons=[],
        evidence=evidence,
        checks={"confirmation": "not run", "numerics": "not run", "regression": "not run"},
    )

    if (
        current_good is not None
        and current_good.fingerprint == cand.policy.fingerprint()
        and current_good.micro_batch == cand.micro_batch
    ):
        decision.unchanged = True
        decision.reasons.append(f"the candidate is already the current good policy (run {current_good.run_id})")
        return decision

    # 1. Confirmation: long enough that a lucky short trial or a slowly growing peak shows.
    want = cfg.confirm_factor * steps
    tell(f"gate: confirming {cand.policy.fingerprint()} over {want} measured steps ...")
    conf = run_trial(
        recipe,
        cand.policy,
        micro_batch=cand.micro_batch,
        warmup_steps=warmup,
        measure_steps=want,
        timeout_s=timeout * cfg.confirm_factor,
        budget_bytes=budget_bytes,
    )
    decision.confirmation = conf
    evidence["confirmation"] = _as_dict(conf)
    got = len(getattr(conf, "step_times_s", ()) or ())
    failure = None
    if conf.outcome != "ok":
        failure = f"confirmation run ended {conf.outcome}" + (f": {conf.error}" if getattr(conf, "error", None) else "")
        if conf.outcome == "over_budget":
            failure = (
                f"confirmation run peaked at {format_bytes(conf.peak_bytes)}, "
                f"over the budget limit {format_bytes(budget_bytes)}"
            )
    elif budget_bytes is not None and (conf.peak_bytes is None or conf.peak_bytes > budget_bytes):
        failure = (
            f"confirmation run peaked at {format_bytes(conf.peak_bytes)},"
            f" over the budget limit {format_bytes(budget_bytes)}"
            if conf.peak_bytes is not None
            else "confirmation run reported no peak memory to check the budget"
        )
    elif got < want:
        failure = f"confirmation run measured {got} steps; the gate needs {want} ({cfg.confirm_factor}x {steps})"
    if failure:
        return _fail(decision, "confirmation", failure)
    decision.checks["confirmation"] = "passed"
    decision.reasons.append(
        f"confirmation: {got} measured steps ({cfg.confirm_factor}x a trial), ok, peak {format_bytes(conf.peak_bytes)}"
        + (f" <= limit {format_bytes(budget_bytes)}" if budget_bytes is not None else "")
    )

    # 2. Numerics: a recomputation that changes gradients is a bug, however fast.
    tell("gate: checking numerics against no recompute ...")
    num = check_numerics(recipe, cand.policy, micro_batch=cand.micro_batch, timeout_s=timeout)
    evidence["numerics"] = _as_dict(num)
    if not num.equal:
        return _fail(
            decision, "numerics", f"numerics differ from no recompute (max abs diff {num.max_abs_diff:g}): {num.detail}"
        )
    decision.checks["numerics"] = "passed"
    decision.reasons.append(f"numerics: loss and gradients equal to no recompute ({num.detail})")

    # 3. Regression: never trade the good policy for a slower one, unless it no longer fits.
    over = _over_limit(current_good, budget_bytes)
    if current_good is None:
        decision.checks["regression"] = "passed"
        evidence["regression"] = {"skipped": "no current good policy to compare against"}
        decision.reasons.append("regression: no current good policy to compare against")
    elif over is not None:
        decision.checks["regression"] = "passed"
        evidence["regression"] = {"skipped": over}
        decision.reasons.append(f"regression: not compared: {over}")
    else:
        tell(f"gate: measuring the candidate and the current good policy side by side ({cfg.rounds} rounds) ...")
        failure = _side_by_side(
            decision,
            cand,
            current_good,
            recipe=recipe,
            budget_bytes=budget_bytes,
            run_trial=run_trial,
            settings=cfg,
            warmup=warmup,
            steps=steps,
            timeout=timeout,
        )
        if failure:
            return _fail(decision, "regression", failure)
    decision.promoted = True
    return decision


def decide(
    tracker: Tracker,
    candidate: Candidate | RecomputePolicy,
    *,
    recipe: Recipe,
    budget_bytes: int | None,
    output_path: str | Path | None = None,
    run_trial: RunTrial | None = None,
    check_numerics: CheckNumerics | None = None,
    settings: GateSettings | None = None,
    progress: Progress | None = None,
) -> GateDecision:
    """`evaluate` against the tracker's current good policy, then record the outcome.

    The confirmation run is logged (it becomes the good run on promotion, since it holds the
    longest measurement of the policy). A pass promotes: ``output_path`` (default
    ``recipe.output``) is written atomically and the experiment's good run moves. A failure is
    recorded as a rejection with its reason, and the file is not touched. An unchanged candidate
    records nothing.
    """
    cand = candidate if isinstance(candidate, Candidate) else Candidate(policy=candidate)
    decision = evaluate(
        cand,
        tracker.current_good(),
        recipe=recipe,
        budget_bytes=budget_bytes,
        run_trial=run_trial,
        check_numerics=check_numerics,
        settings=settings,
        progress=progress,
    )
    if decision.unchanged:
        return decision
    # The file and every run's policy.yaml carry what the policy was tuned for, so a training job
    # reading either (a path or "mlflow:") can tell when its batch is larger than the one measured.
    policy = cand.policy.with_tuned_for(tuned_for(recipe, cand, decision.confirmation, budget_bytes))
    decision.evidence["tuned_for"] = policy.tuned_for.to_dict() if policy.tuned_for is not None else None
    source = cand.source_run_id
    if decision.confirmation is not None:
        source = tracker.log_confirmation(
            policy,
            cand.layer_names,
            cand.micro_batch,
            decision.confirmation,
            source_run_id=cand.source_run_id,
            evidence=decision.evidence,
        )
        decision.confirmation_run_id = source
    if decision.promoted:
        out = Path(output_path) if output_path is not None else Path(recipe.output)
        decision.decision_run_id = tracker.promote(
            policy, source_run_id=source, output_path=out, reason=decision.reason, evidence=decision.evidence
        )
    else:
        decision.decision_run_id = tracker.reject(
            policy, source_run_id=source, reason=decision.reason, evidence=decision.evidence
        )
    return decision


def tuned_for(
    recipe: Recipe, candidate: Candidate, confirmation: TrialResult | None, budget_bytes: int | None
) -> TunedFor:
    """What ``candidate`` was tuned for: its micro-batch (the data module's own when it has none),
    the confirmation run's peak and device, the budget limit, and the recipe."""
    from tuner.recipe import data_batch_size

    data_batch = data_batch_size(recipe)
    measured = confirmation is not None and confirmation.outcome in ("ok", "over_budget")
    return TunedFor(
        micro_batch=candidate.micro_batch if candidate.micro_batch is not None else data_batch,
        data_batch_size=data_batch,
        peak_bytes=(confirmation.peak_bytes or None) if measured and confirmation is not None else None,
        limit_bytes=budget_bytes,
        device=(confirmation.device or None) if confirmation is not None else None,
        recipe=recipe.name,
        recipe_fingerprint=recipe.fingerprint(),
    )


def _side_by_side(
    decision: GateDecision,
    cand: Candidate,
    good: GoodPolicy,
    *,
    recipe: Recipe,
    budget_bytes: int | None,
    run_trial: RunTrial,
    settings: GateSettings,
    warmup: int,
    steps: int,
    timeout: float,
) -> str | None:
    """Interleaved re-measurement; a failure reason, or ``None`` (and a pass line in ``decision``)."""
    runs: list[dict[str, Any]] = []
    cand_thr: list[float] = []
    good_thr: list[float] = []
    good_failed: list[str] = []
    for i in range(settings.rounds):
        # ABBA order: whatever drifts over the gate's minutes (thermals, a neighbour's job) lands
        # on both sides alike instead of always on the second.
        order = ("candidate", "good") if i % 2 == 0 else ("good", "candidate")
        for who in order:
            side = cand if who == "candidate" else good
            # Both under the same limit: a good policy that no longer fits (a tightened budget, a
            # grown model) is no contender, however fast.
            res = run_trial(
                recipe,
                side.policy,
                micro_batch=side.micro_batch,
                warmup_steps=warmup,
                measure_steps=steps,
                timeout_s=timeout,
                budget_bytes=budget_bytes,
            )
            runs.append({"round": i, "who": who, **_as_dict(res)})
            if who == "candidate":
                if res.outcome != "ok" or res.throughput is None:
                    decision.evidence["regression"] = {"runs": runs}
                    return f"side-by-side run {i + 1} of the candidate ended {res.outcome}" + (
                        f": {res.error}" if getattr(res, "error", None) else ""
                    )
                cand_thr.append(float(res.throughput))
            elif res.outcome == "ok" and res.throughput is not None:
                good_thr.append(float(res.throughput))
            elif res.outcome == "over_budget":
                decision.evidence["regression"] = {"runs": runs}
                decision.checks["regression"] = "passed"
                decision.reasons.append(
                    f"regression: not compared: the current good policy (run {good.run_id}) peaked at "
                    f"{format_bytes(res.peak_bytes)} side by side, over the budget limit {format_bytes(budget_bytes)}: "
                    "it does not fit, so it is no contender"
                )
                return None
            else:
                good_failed.append(str(res.outcome))
    cand_med = statistics.median(cand_thr)
    unit = getattr(decision.confirmation, "throughput_unit", "") or ""
    ev: dict[str, Any] = {"runs": runs, "candidate_median": cand_med, "tolerance": settings.tolerance}
    decision.evidence["regression"] = ev
    if not good_thr:
        # The good policy no longer runs here (a changed model or machine); nothing to be slower than.
        ev["good_median"] = None
        decision.checks["regression"] = "passed"
        decision.reasons.append(
            f"regression: the current good policy failed to run ({', '.join(good_failed)}); "
            f"candidate median {cand_med:.4g} {unit}"
        )
        return None
    good_med = statistics.median(good_thr)
    ratio = cand_med / good_med if good_med > 0 else float("inf")
    ev.update({"good_median": good_med, "ratio": ratio})
    floor = good_med * (1.0 - settings.tolerance)
    line = (
        f"candidate median {cand_med:.4g} vs current good {good_med:.4g} {unit} "
        f"(ratio {ratio:.3f}, {settings.rounds} interleaved rounds, {settings.tolerance:.0%} noise tolerance)"
    )
    if cand_med < floor:
        return f"slower than the current good policy (run {good.run_id}): {line}"
    decision.checks["regression"] = "passed"
    decision.reasons.append(f"regression: not slower: {line}")
    return None


def _over_limit(good: GoodPolicy | None, budget_bytes: int | None) -> str | None:
    """Why the current good policy is no contender under ``budget_bytes`` by its recorded peak, or ``None``."""
    if good is None or budget_bytes is None or good.peak_bytes is None or good.peak_bytes <= budget_bytes:
        return None
    return (
        f"the current good policy (run {good.run_id}) peaked at {format_bytes(good.peak_bytes)}, over the budget "
        f"limit {format_bytes(budget_bytes)}: it does not fit, so it is no contender"
    )


def _fail(decision: GateDecision, check: str, reason: str) -> GateDecision:
    decision.checks[check] = "failed"
    decision.reasons = [f"{check}: {reason}", *decision.reasons]
    decision.promoted = False
    return decision


def _as_dict(result: TrialResult | NumericsResult) -> dict[str, Any]:
    d = jsonable(result)
    return d if isinstance(d, dict) else {"value": d}
