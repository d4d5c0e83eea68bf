"""The evidence gate: a search winner becomes the good policy only after it proves itself again, by three checks,
cheapest first (confirmation, numerics, regression; docs/TUNER.md, "What the gate guarantees"). `evaluate`
decides, `decide` also records; the runners are injectable for tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_recompute.policy import RecomputePolicy
from lightning_recompute.tuned_for import TunedFor
from lightning_recompute.units import format_bytes, jsonable

if TYPE_CHECKING:
    from lightning_recompute.race import RaceEntrant, RaceResult
    from tuner._tracking import GoodPolicy, Tracker
    from tuner._trials import NumericsResult, TrialResult
    from tuner.recipe import Recipe

__all__ = ["Candidate", "GateDecision", "decide", "evaluate", "longest_s", "tuned_for"]

RunTrial = Callable[..., "TrialResult"]
RunRace = Callable[..., "RaceResult"]
CheckNumerics = Callable[..., "NumericsResult"]
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Candidate:
    """The policy the search proposes for promotion."""

    policy: RecomputePolicy
    micro_batch: int | None = None  # the micro-batch it won with (None: the data module's own)
    source_run_id: str | None = None  # the MLflow trial run it won in, if any
    layer_names: tuple[str, ...] | None = None  # for the confirmation run's per-layer params (None: the patterns)


CONFIRM_FACTOR = 3
"""The confirmation run measures this many times a trial's measure_steps."""
CONFIRM_SLACK = 0.25
"""How far below the race's figure a confirmation (another process, minutes later) may measure before it fails."""


def longest_s(recipe: Recipe) -> float:
    """The longest `evaluate` can take under ``recipe``, every run at its deadline (another worker waits this
    long for the gate's lease)."""
    trial_s, race_s = float(recipe.trial.timeout_s), float(recipe.race_plan().time_s)
    return trial_s * (2 * CONFIRM_FACTOR + 4) + 2 * (2 * race_s)


@dataclass
class GateDecision:
    """What the gate concluded, and on what evidence."""

    promoted: bool
    reasons: list[str]  # one line per passed check, or why it failed (the failed check first)
    evidence: dict[str, Any]  # everything measured, JSON-ready (evidence.json)
    unchanged: bool = False  # the candidate is already the good policy: nothing run, nothing to record
    confirmation: TrialResult | None = None
    decision_run_id: str | None = None  # the MLflow decision run (`decide` fills it in)
    confirmation_run_id: str | None = None  # the MLflow confirmation run (`decide` fills it in)
    checks: dict[str, str] = field(default_factory=dict)  # check name -> passed / failed / not run

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


def evaluate(
    candidate: Candidate | RecomputePolicy,
    current_good: GoodPolicy | None,
    *,
    recipe: Recipe,
    budget_bytes: int | None,
    run_trial: RunTrial | None = None,
    check_numerics: CheckNumerics | None = None,
    run_race: RunRace | None = None,
    race: RaceResult | None = None,
    progress: Progress | None = None,
) -> GateDecision:
    """Run the three checks on ``candidate`` against ``current_good``, touching no file and no record; ``race``, the
    race the candidate won, is what the confirmation and (when the good policy raced too) the regression read."""
    from tuner import _trials as trials

    cand = candidate if isinstance(candidate, Candidate) else Candidate(policy=candidate)
    gate = _Gate(
        recipe,
        cand,
        current_good,
        budget_bytes,
        progress or (lambda _line: None),
        run_trial or trials.run_trial,
        check_numerics or trials.check_numerics,
        run_race or trials.run_race,
        race,
    )
    d, good = gate.decision, current_good
    if good is not None and (good.fingerprint, good.micro_batch) == (cand.policy.fingerprint(), cand.micro_batch):
        d.unchanged = True
        d.reasons.append(f"the candidate is already the current good policy (run {good.run_id})")
        return d
    for name, check in (("confirmation", gate.confirm), ("numerics", gate.numerics), ("regression", gate.regression)):
        failure = check()
        d.checks[name] = "passed" if failure is None else "failed"
        if failure is not None:
            d.reasons.insert(0, f"{name}: {failure}")
            return d
    d.promoted = True
    return d


@dataclass
class _Gate:
    """One `evaluate` call; each check returns why the candidate failed it, or ``None`` having said why it passed."""

    recipe: Recipe
    cand: Candidate
    good: GoodPolicy | None
    budget: int | None
    tell: Progress
    run_trial: RunTrial
    check_numerics: CheckNumerics
    run_race: RunRace
    race: RaceResult | None
    decision: GateDecision = field(init=False)

    def __post_init__(self) -> None:
        cand, good = self.cand, self.good
        self.evidence: dict[str, Any] = {
            "candidate": {
                "fingerprint": cand.policy.fingerprint(),
                "micro_batch": cand.micro_batch,
                "source_run_id": cand.source_run_id,
                "policy": cand.policy.to_dict(),
            },
            "current_good": None
            if good is None
            else {
                "run_id": good.run_id,
                "fingerprint": good.fingerprint,
                "micro_batch": good.micro_batch,
                "throughput": good.throughput,
                "peak_bytes": good.peak_bytes,
            },
            "budget_bytes": self.budget,
            "settings": {"confirm_factor": CONFIRM_FACTOR, "confirm_slack": CONFIRM_SLACK},
        }
        checks = dict.fromkeys(("confirmation", "numerics", "regression"), "not run")
        self.decision = GateDecision(promoted=False, reasons=[], evidence=self.evidence, checks=checks)

    def _trial(self, policy: RecomputePolicy, micro_batch: int | None, factor: int = 1) -> TrialResult:
        t = self.recipe.trial
        return self.run_trial(
            self.recipe,
            policy,
            micro_batch=micro_batch,
            warmup_steps=int(t.warmup_steps),
            measure_steps=factor * int(t.measure_steps),
            timeout_s=float(t.timeout_s) * factor,
            budget_bytes=self.budget,
        )

    def _race_against(self, other: RecomputePolicy, labels: list[str]) -> RaceResult:
        return self.run_race(
            self.recipe,
            [(self.cand.policy, ["candidate"]), (other, labels)],
            layer_names=self.cand.layer_names or (),
            references=[other],
            micro_batch=self.cand.micro_batch,
            budget_bytes=self.budget,
        )

    def confirm(self) -> str | None:
        """1. Confirmation: long enough that a lucky short trial or a slowly growing peak shows."""
        cand, budget = self.cand, self.budget
        want = CONFIRM_FACTOR * int(self.recipe.trial.measure_steps)
        self.tell(f"gate: confirming {cand.policy.fingerprint()} over {want} measured steps ...")
        conf = self._trial(cand.policy, cand.micro_batch, CONFIRM_FACTOR)
        failure = _unconfirmed(conf, want, budget)
        slow = None if failure else _slower_than_raced(conf, cand.policy, self.race)
        if slow is not None:
            conf, failure = self._slow_confirmation(conf, slow, want)
        self.decision.confirmation = conf
        self.evidence["confirmation"] = _as_dict(conf)
        if failure:
            return failure
        self.decision.reasons.append(
            f"confirmation: {len(conf.step_times_s)} measured steps ({CONFIRM_FACTOR}x a trial), ok, "
            f"peak {format_bytes(conf.peak_bytes)}"
            + (f" <= limit {format_bytes(budget)}" if budget is not None else "")
        )
        if "confirmation_held" in self.evidence:
            self.decision.reasons.append(f"confirmation: {self.evidence['confirmation_held']}")
        return None

    def _slow_confirmation(self, conf: TrialResult, slow: str, want: int) -> tuple[TrialResult, str | None]:
        """The confirmation that counts and why it fails: load only slows a run, so the faster of two counts; slow
        twice, the candidate passes if it keeps its standing raced again against a reference of the session's race
        (a slowed machine slows both alike). Without a reference, two slow runs fail."""
        cand, race = self.cand, self.race
        self.evidence["confirmation_slow"] = _as_dict(conf)
        self.tell(f"gate: {slow}; measuring once more ...")
        again = self._trial(cand.policy, cand.micro_batch, CONFIRM_FACTOR)
        failure = _unconfirmed(again, want, self.budget)  # a second run failing on its own terms stands
        if failure is not None:
            return again, failure
        if (again.throughput or 0.0) > (conf.throughput or 0.0):
            conf = again
        failure = _slower_than_raced(conf, cand.policy, race)
        ref = _reference_entrant(race, cand.policy.fingerprint())
        if failure is None or ref is None or ref.policy is None or race is None:
            return conf, failure
        self.tell(
            f"gate: slow again; racing it against {ref.short} ({ref.label}) interleaved, to tell a slowed "
            "machine from a slow policy ..."
        )
        pair = self._race_against(RecomputePolicy.from_dict(ref.policy), list(ref.labels))
        self.evidence["confirmation_race"] = pair.to_dict()
        kept, held = _held_against(pair, ref, cand.policy.fingerprint(), race)
        if kept:
            self.evidence["confirmation_held"] = f"slower than the race in its own process, but it {held}"
            return conf, None
        return conf, f"{failure}; and it {held}"

    def numerics(self) -> str | None:
        """2. Numerics: a recomputation that changes training is a bug, however fast."""
        self.tell("gate: checking numerics against no recompute ...")
        cand = self.cand
        num = self.check_numerics(
            self.recipe, cand.policy, micro_batch=cand.micro_batch, timeout_s=float(self.recipe.trial.timeout_s)
        )
        self.evidence["numerics"] = _as_dict(num)
        if not num.equal:
            return f"numerics differ from no recompute (max abs diff {num.max_abs_diff:g}): {num.detail}"
        self.decision.reasons.append(f"numerics: training unchanged from no recompute ({num.detail})")
        return None

    def regression(self) -> str | None:
        """3. Regression: never trade the good policy for a slower one, unless it no longer fits."""
        from lightning_recompute.race import format_gain

        good, budget, reasons = self.good, self.budget, self.decision.reasons
        if good is None:
            self.evidence["regression"] = {"skipped": "no current good policy to compare against"}
            reasons.append("regression: no current good policy to compare against")
            return None
        if budget is not None and good.peak_bytes is not None and good.peak_bytes > budget:
            why = (
                f"the current good policy (run {good.run_id}) peaked at {format_bytes(good.peak_bytes)}, over the "
                f"budget limit {format_bytes(budget)}: it does not fit, so it is no contender"
            )
            self.evidence["regression"] = {"skipped": why}
            reasons.append(f"regression: not compared: {why}")
            return None
        race = self.race
        if race is None or not race.ok or not {self.cand.policy.fingerprint(), good.fingerprint} <= set(race.entrants):
            self.tell("gate: racing the candidate against the current good policy, interleaved ...")
            race = self._race_against(good.policy, ["good"])
        if race.outcome == "failed":
            # The current good policy failing alone too (a changed model or machine) blocks nothing.
            alone = self._trial(good.policy, good.micro_batch)
            if not alone.measured:
                self.evidence["regression"] = {"race": race.to_dict(), "good_alone": _as_dict(alone)}
                reasons.append(
                    f"regression: the current good policy failed to run ({alone.outcome}"
                    + (f": {alone.error}" if alone.error else "")
                    + "); nothing to be slower than"
                )
                return None
        self.evidence["regression"] = race.to_dict()
        if not race.ok:
            return f"the race against the current good policy (run {good.run_id}) failed: {race.reason}"
        c, g = self.cand.policy.fingerprint(), good.fingerprint
        good_entrant = race.entrants.get(g)
        if good_entrant is not None and good_entrant.out is not None:
            reasons.append(
                f"regression: not compared: the current good policy (run {good.run_id}) {good_entrant.out}: "
                "it does not fit, so it is no contender"
            )
            return None
        interval = race.vs.get(g) if race.winner == c else race.vs.get(c) if race.winner == g else None
        if interval is None:  # the session's race: the selection's standing has the pair
            interval = race.behind.get(g) if race.leader == c else race.behind.get(c) if race.leader == g else None
        tie = race.tie_line()
        figures = f" ({tie})" if tie else f": {format_gain(interval, race.confidence)}" if interval is not None else ""
        if race.winner == c:
            reasons.append(
                f"regression: the race put the candidate ahead of the current good policy (run {good.run_id}){figures}"
            )
            return None
        if race.winner == g:
            return f"the current good policy (run {good.run_id}) won the race against the candidate{figures}"
        return f"the race against the current good policy (run {good.run_id}) chose neither ({race.winner})"


def decide(
    tracker: Tracker,
    cand: Candidate,
    *,
    recipe: Recipe,
    budget_bytes: int | None,
    output_path: str | Path | None = None,
    **runners: Any,
) -> GateDecision:
    """`evaluate` against the current good policy, then record the confirmation run and a promotion writing
    ``output_path`` (default ``recipe.output``) or a rejection; an unchanged candidate records nothing."""
    good = tracker.registry.current_good()
    decision = evaluate(cand, good, recipe=recipe, budget_bytes=budget_bytes, **runners)
    if decision.unchanged:
        return decision
    # What the policy was tuned for travels with it, so a training job can tell a larger batch than measured.
    policy = cand.policy.with_tuned_for(tuned_for(recipe, cand, decision.confirmation, budget_bytes))
    decision.evidence["tuned_for"] = policy.tuned_for.to_dict() if policy.tuned_for is not None else None
    source = cand.source_run_id
    if decision.confirmation is not None:
        # A trial run's shape plus ``evidence.json``, so a promoted confirmation run is a self-contained good run.
        conf, ev = decision.confirmation, decision.evidence
        source = decision.confirmation_run_id = tracker.sessions.log_trial(
            None, policy, cand.layer_names, cand.micro_batch, conf, source=cand.source_run_id, evidence=ev
        )
    said: dict[str, Any] = {"source_run_id": source, "reason": decision.reason, "evidence": decision.evidence}
    if decision.promoted:
        out = Path(output_path if output_path is not None else recipe.output)
        decision.decision_run_id = tracker.registry.promote(policy, output_path=out, **said)
    else:
        decision.decision_run_id = tracker.registry.reject(policy, **said)
    return decision


def tuned_for(
    recipe: Recipe, candidate: Candidate, confirmation: TrialResult | None, budget_bytes: int | None
) -> TunedFor:
    """What ``candidate`` was tuned for: its micro-batch (the largest measured when the data's batches
    vary), the confirmation's peak and device, the budget limit and the recipe."""
    from tuner.recipe._build import data_batch_size

    data_batch = data_batch_size(recipe)
    measured = confirmation if confirmation is not None and confirmation.measured else None
    micro_batch = candidate.micro_batch if candidate.micro_batch is not None else data_batch
    if measured is not None and measured.batches and measured.batches.get("varies"):
        # The budget held for the largest batch only; it is also the data's own, so the job needs no change.
        micro_batch = data_batch = int(measured.batches["largest_samples"])
    return TunedFor(
        micro_batch=micro_batch,
        data_batch_size=data_batch,
        peak_bytes=(measured.peak_bytes or None) if measured is not None else None,
        limit_bytes=budget_bytes,
        device=(confirmation.device or None) if confirmation is not None else None,
        recipe=recipe.name,
        recipe_fingerprint=recipe.fingerprint(),
    )


def _unconfirmed(conf: TrialResult, want: int, budget_bytes: int | None) -> str | None:
    """Why a confirmation run fails the gate on its own (outcome, peak, steps measured), or ``None``."""
    if conf.outcome not in ("ok", "over_budget"):
        return f"confirmation run ended {conf.outcome}" + (f": {conf.error}" if conf.error else "")
    if conf.outcome == "ok" and budget_bytes is not None and conf.peak_bytes is None:
        return "confirmation run reported no peak memory to check the budget"
    if conf.outcome == "over_budget" or (budget_bytes is not None and (conf.peak_bytes or 0) > budget_bytes):
        return (
            f"confirmation run peaked at {format_bytes(conf.peak_bytes)}, "
            f"over the budget limit {format_bytes(budget_bytes)}"
        )
    if len(conf.step_times_s or ()) < want:
        return (
            f"confirmation run measured {len(conf.step_times_s or ())} steps; the gate needs {want} "
            f"({CONFIRM_FACTOR}x a trial's)"
        )
    return None


def _slower_than_raced(conf: TrialResult, policy: RecomputePolicy, race: RaceResult | None) -> str | None:
    """Why the confirmation contradicts the race's figure for ``policy``, scaled by `RaceResult.trial_scale` (a run
    in its own process measures lower than a warm race), or ``None``."""
    raced = race.throughput(policy.fingerprint()) if race is not None and race.ok else None
    if race is None or raced is None or conf.throughput is None:
        return None
    scale = race.trial_scale or 1.0
    expected = raced * scale
    if conf.throughput >= expected * (1.0 - CONFIRM_SLACK):
        return None
    unit = conf.throughput_unit or race.unit
    how = f" ({scale:.2f}x the race's {raced:.4g}: the lowest a raced trial measured)" if race.trial_scale else ""
    return (
        f"confirmation run measured {conf.throughput:.4g} {unit}, {1 - conf.throughput / expected:.0%} below the "
        f"{expected:.4g} {unit} expected of this policy in its own process{how}, more than the "
        f"{CONFIRM_SLACK:.0%} allowed between runs: the race's figure did not hold up"
    )


def _reference_entrant(race: RaceResult | None, candidate: str) -> RaceEntrant | None:
    """The entrant of ``race`` to re-measure beside a slow confirmation of ``candidate``, or ``None``: a
    headline reference first, then the fastest other one within the limit with its policy on record."""
    if race is None or not race.ok:
        return None
    others = [
        e
        for k, e in race.entrants.items()
        if k != candidate and e.out is None and e.policy is not None and race.throughput(k)
    ]
    return min(others, key=lambda e: (e.key not in race.vs, -(race.throughput(e.key) or 0.0)), default=None)


def _held_against(pair: RaceResult, ref: RaceEntrant, candidate: str, race: RaceResult) -> tuple[bool, str]:
    """Whether the candidate kept its standing against ``ref`` when raced again (``pair``), and the words."""
    now_c, now_r = pair.throughput(candidate), pair.throughput(ref.key)
    then_c, then_r = race.throughput(candidate), race.throughput(ref.key)
    if not (pair.ok and now_c and now_r and then_c and then_r):
        why = pair.reason or "no figure for one of the two"
        return False, f"could not be compared with {ref.short} ({ref.label}) raced again ({pair.outcome}: {why})"
    now, then = now_c / now_r, then_c / then_r
    figures = (
        f"{now:.2f}x the throughput of {ref.short} ({ref.label}) raced again interleaved "
        f"({pair.select_rounds + pair.estimate_rounds} rounds), against {then:.2f}x in the session's race "
        f"(at most {CONFIRM_SLACK:.0%} less allowed)"
    )
    if now >= then * (1.0 - CONFIRM_SLACK):
        return True, f"kept its standing: the machine slowed, not the policy: {figures}"
    return False, f"did not keep its standing either: {figures}"


def _as_dict(result: TrialResult | NumericsResult) -> dict[str, Any]:
    d = jsonable(result)
    return d if isinstance(d, dict) else {"value": d}
