"""From a finished search to the good policy: the race of the leading trials, the gate's candidate, and
the gate (`tuner._gate.decide`), all under the study's gate lease (`tuner._search.gate_lease`: two races
at once would measure each other). Without new trials since the last decision the good policy stands
unraced: racing again would only re-roll the noise that race settled.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_recompute.errors import RecomputeError
from lightning_recompute.policy import RecomputePolicy
from tuner._gate import Candidate, GateDecision, GateSettings, decide
from tuner._search import gate_lease
from tuner._search.seeds import Source, pick_of
from tuner.exits import EXIT_INFEASIBLE, EXIT_OK
from tuner.recipe._schema import PREDICTION_SPAN

if TYPE_CHECKING:
    from lightning_recompute.race import RaceResult
    from tuner._search import TrialRecord, TuningStudy
    from tuner._tracking import GoodPolicy, Tracker
    from tuner.recipe import Recipe

__all__ = ["Decided", "Field", "candidate_of", "choose_field", "decide_best", "race_leaders"]

Say = Callable[[str], None]


@dataclass(frozen=True)
class Decided:
    """What `decide_best` decided."""

    decision: GateDecision
    race: RaceResult | None  # the race before the gate (None: not run)
    chosen: str | None  # the race winner's fingerprint, or the good policy's that stood unraced; None: no race chose

    def status(self) -> tuple[str, int]:
        """The session's status and exit code."""
        if self.decision.unchanged:
            return "current", EXIT_OK
        return ("promoted", EXIT_OK) if self.decision.promoted else ("rejected", EXIT_INFEASIBLE)


@dataclass(frozen=True)
class Stage:
    """The session's recipe, space, budget, records and voices, as the decision needs them."""

    recipe: Recipe
    layer_names: tuple[str, ...]
    budget: int
    study_name: str
    tracker: Tracker
    session_run_id: str | None
    notify: Say  # progress (printed, not kept)
    note: Say  # a decision along the way (printed and kept in the session's notes)
    killable: Callable[[Callable[..., Any]], Callable[..., Any]]  # the first Ctrl-C stops what it wraps
    stop: threading.Event  # set by a Ctrl-C: a wait for the lease ends


def decide_best(stage: Stage, best: TrialRecord, study: TuningStudy, *, new_trials: bool) -> Decided:
    """Race the leaders of ``study`` and gate the winner (``best`` is its best feasible trial) under the lease;
    ``new_trials``: whether this session measured any trial."""
    from tuner._trials import check_numerics, run_race, run_trial

    recipe, settings = stage.recipe, GateSettings()
    wait_s = settings.longest_s(recipe) + 60.0
    lease = (
        gate_lease(study.storage, stage.study_name, wait_s=wait_s, on_wait=stage.notify, cancel=stage.stop)
        if study.storage is not None
        else contextlib.nullcontext(False)
    )
    with lease as waited:
        good = stage.tracker.registry.current_good()
        records = study.records()
        race: RaceResult | None
        chosen: str | None
        if (not new_trials or waited) and good is not None and good.micro_batch == best.micro_batch:
            why = "another worker decided while this one waited" if waited else "no new trial since the last decision"
            stage.note(f"race: not run: {why}; the current good policy stands")
            race, chosen = None, good.fingerprint
            candidate = Candidate(good.policy, good.micro_batch, good.run_id, stage.layer_names)
        else:
            race = race_leaders(stage, best, good, records, stage.killable(run_race))
            candidate = candidate_of(best, race, good, records, stage.layer_names)
            chosen = race.winner if race is not None and race.ok else None
        stage.notify(f"gate: {candidate.policy.short(stage.layer_names)} is the candidate")
        decision = decide(
            stage.tracker,
            candidate,
            recipe=recipe,
            budget_bytes=stage.budget,
            output_path=recipe.output,
            run_trial=stage.killable(run_trial),
            check_numerics=stage.killable(check_numerics),
            run_race=stage.killable(run_race),
            race=race,
            settings=settings,
            progress=stage.notify,
        )
    if waited and decision.unchanged:
        decision.reasons.append("another worker ran the gate for this study while this one waited")
    return Decided(decision=decision, race=race, chosen=chosen)


def race_leaders(
    stage: Stage,
    best: TrialRecord,
    good: GoodPolicy | None,
    records: Sequence[TrialRecord],
    run_race: Callable[..., RaceResult],
) -> RaceResult | None:
    """Race the leading candidates; ``None`` when the recipe turns the race off."""
    from lightning_recompute.race import RaceResult

    recipe = stage.recipe
    if not recipe.race.enabled:
        stage.note("race: off in the recipe; the best single trial is gated and no 'vs' figure is given")
        return None
    # The search's cost sets the race's: a race of a fixed length would double a short search.
    search_s = sum(r.wall_s for r in records if r.ran and r.wall_s is not None)
    plan = recipe.race_plan(search_s=search_s)
    entry = choose_field(records, best, good, leaders=plan.leaders, predicted=plan.predicted, budget_bytes=stage.budget)
    for line in entry.notes:
        stage.note(f"race: {line}")
    if recipe.trainer.devices > 1 or recipe.trainer.num_nodes > 1:
        entry.skipped = "multi-device trials are not raced yet (one process races on one device)"
    if entry.skipped is not None:
        stage.note(f"race: not run: {entry.skipped}")
        return RaceResult(outcome="skipped", reason=entry.skipped)
    names = ", ".join(f"{p.short(stage.layer_names)} ({' = '.join(labels)})" for p, labels in entry.entrants)
    stage.notify(f"race: {len(entry.entrants)} candidates interleaved in one process: {names} ...")
    if plan.total_s is not None and plan.share is not None:
        by_share = plan.share * search_s
        share = f"{plan.share:.0%} of the search's {search_s:.0f} s of trials"
        if plan.total_s > by_share:
            why = f"the race's floor of {plan.min_s:.0f} s; race.share's {share} would be {by_share:.0f} s"
        else:
            why = f"{share}, race.share"
        stage.note(f"race: at most {plan.total_s:.0f} s of rounds ({why})")
    race = run_race(
        recipe,
        entry.entrants,
        layer_names=stage.layer_names,
        references=entry.references,
        micro_batch=entry.micro_batch,
        budget_bytes=stage.budget,
        plan=plan,
    )
    if race.ok and race.winner is not None:
        race = race.calibrated({r.fingerprint: r.throughput for r in records if r.ran})
        won = race.entrants[race.winner].short if race.winner is not None else "?"
        stage.notify(f"race: {won} won after {race.select_rounds} rounds ({race.stop})")
        for said in (*race.decision_lines(), *race.headlines()):
            if said:
                stage.notify(f"race: {said}")
    else:
        stage.note(f"race: {race.outcome}: {race.reason}; the best single trial is gated")
    if stage.session_run_id is not None:
        stage.tracker.sessions.log_race(race)
    return race


def candidate_of(
    best: TrialRecord,
    race: RaceResult | None,
    good: GoodPolicy | None,
    records: Sequence[TrialRecord],
    layer_names: tuple[str, ...],
) -> Candidate:
    """The gate's candidate: the race's winner, or without one the best single trial."""
    policy, source = best.policy, best.run_id
    if race is not None and race.ok:
        won = next((r for r in records if r.ran and r.fingerprint == race.winner), None)
        if won is not None:
            policy, source = won.policy, won.run_id
        elif good is not None and good.fingerprint == race.winner:
            policy, source = good.policy, good.run_id
    if policy is None:
        raise RecomputeError(f"trial {best.number}: the study's record holds no policy to gate")
    return Candidate(policy=policy, micro_batch=best.micro_batch, source_run_id=source, layer_names=layer_names)


@dataclass
class Field:
    """The entrants of a race and the references of its "vs" figures, or why there is no race.

    Who races: the leading trials, the planner's pick and top predictions (independent of one run's noise),
    the fastest fitting baseline and full (the "vs" figures are about them) and the current good policy.
    """

    entrants: list[tuple[RecomputePolicy, list[str]]] = field(default_factory=list)  # (policy, labels), leader first
    references: list[RecomputePolicy] = field(default_factory=list)  # the baselines the winner is compared with
    micro_batch: int | None = None  # the micro-batch every entrant runs at (the best trial's)
    skipped: str | None = None  # why no race is run (None: race)
    notes: list[str] = field(default_factory=list)  # candidates left out, and why

    def has(self, fingerprint: str) -> bool:
        return any(p.fingerprint() == fingerprint for p, _ in self.entrants)

    def add(self, policy: RecomputePolicy, label: str) -> None:
        for existing, labels in self.entrants:
            if existing.fingerprint() == policy.fingerprint():
                if label not in labels:
                    labels.append(label)
                return
        self.entrants.append((policy, [label]))


def choose_field(
    records: Sequence[TrialRecord],
    best: TrialRecord,
    good: GoodPolicy | None,
    *,
    leaders: int,
    budget_bytes: int | None,
    predicted: int = 0,
) -> Field:
    """The race's field after a search whose best feasible trial is ``best``.

    ``leaders``: how many of the fastest fitting trials race; ``predicted``: how many more race from those the
    planner predicts within `PREDICTION_SPAN` of its fastest prediction, fastest trial first (a best policy that
    one unlucky trial ranked below the leaders still races: `bench/decision_quality.py`). Entrants run at
    ``best``'s micro-batch; compiled policies are left out (switching a compiled layer's policy recompiles it,
    which would be timed as the policy's cost).
    """
    out = Field(micro_batch=best.micro_batch)
    if best.policy is None:
        out.skipped = f"trial {best.number} holds no policy"
        return out
    if best.policy.compile:
        out.skipped = (
            "the best trial compiles its layers, and switching a compiled layer's policy recompiles it: "
            "not raced, its figure is a single run"
        )
        return out
    fitting = [r for r in records if r.feasible and r.measured and r.policy is not None and r.throughput]
    fitting.sort(key=lambda r: (-(r.throughput or 0.0), r.number))
    plain = [r for r in fitting if r.policy is not None and not r.policy.compile]
    # `same`: fitting trials at the best's micro-batch, fastest first; the leaders race, one per policy.
    same = [r for r in plain if r.micro_batch == best.micro_batch]
    leading: dict[str, RecomputePolicy] = {}
    for r in same:
        if r.policy is not None and len(leading) < leaders and r.fingerprint not in leading:
            leading[r.fingerprint] = r.policy
            out.add(r.policy, f"trial {r.number}")
    # The planner's pick, and the fastest baseline and full as the references of the winner's figures.
    planner = [r for r in same if r.source is Source.PLANNER and pick_of(r.label).startswith("budget")]
    if planner and planner[0].policy is not None:
        out.add(planner[0].policy, "planner")
    baselines = [r for r in same if r.baseline is not None]
    if baselines and (fastest := baselines[0].policy) is not None:
        out.add(fastest, f"baseline {baselines[0].baseline or ''}")
        out.references.append(fastest)
    full = next((r for r in same if r.baseline == "full"), None)
    if (
        full is not None
        and full.policy is not None
        and all(p.fingerprint() != full.fingerprint for p in out.references)
    ):
        out.add(full.policy, "baseline full")
        out.references.append(full.policy)
    if good is not None:
        if budget_bytes is not None and good.peak_bytes is not None and good.peak_bytes > budget_bytes:
            out.notes.append("the current good policy is over the budget limit: not raced")
        elif good.micro_batch != best.micro_batch:
            out.notes.append("the current good policy was tuned at another micro-batch: not raced")
        elif good.policy.compile:
            out.notes.append("the current good policy compiles its layers: not raced")
        else:
            out.add(good.policy, "good")
    # Last: the planner's pick, a baseline or the good policy is no extra.
    rated = [(r, p) for r in same if (p := r.predicted_step_time_s) is not None and math.isfinite(p) and p > 0]
    if predicted > 0 and rated:
        top = min(p for _, p in rated) * (1.0 + PREDICTION_SPAN)
        near = [r for r, p in rated if p <= top and r.policy is not None and not out.has(r.fingerprint)]
        for r in near[:predicted]:  # `same` is sorted fastest first
            assert r.policy is not None
            out.add(r.policy, "planner prediction")
    if len(fitting) > len(plain):
        out.notes.append(
            f"{len(fitting) - len(plain)} compiled trial(s) not raced (switching a compiled layer recompiles it)"
        )
    if len(plain) > len(same):
        out.notes.append(f"{len(plain) - len(same)} trial(s) at another micro-batch than the best not raced")
    if len(out.entrants) < 2:
        out.skipped = "only one candidate fits: nothing to race"
    return out
