"""One tuning session, the loop: study -> trials -> tracking -> race and gate -> policy file (docs/ARCHITECTURE.md,
"The pipeline"); workers sharing a study agree through `tuner._workers`."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from lightning_recompute.errors import RecomputeError
from tuner._decision import candidate_of, choose_field
from tuner._gate import Candidate, decide, longest_s
from tuner._interrupts import Interrupts
from tuner._liveness import Heartbeat, grace_s, kill_point
from tuner._search import (
    SearchSpace,
    TuningStudy,
    baseline_seeds,
    best_of,
    far_over_budget,
    gate_lease,
    inspect_layers,
    study_name,
)
from tuner._search.attrs import StudyAttr
from tuner._search.planner_seeds import PlannerSeeds, plan_seeds
from tuner._stores import storage_failure
from tuner._tracking import open_tracker
from tuner._workers import (
    Presence,
    end_dead_session_runs,
    others_fill,
    reap,
    stand_down_reason,
    wait_for_running,
)
from tuner.exits import EXIT_INFEASIBLE, EXIT_INTERRUPTED, EXIT_OK
from tuner.summary import SessionSummary, TrialEvent, summarize, why_infeasible

if TYPE_CHECKING:
    from lightning_recompute.race import RaceResult
    from tuner._search import TrialRecord
    from tuner._tracking import GoodPolicy, Tracker
    from tuner._trials import TrialResult
    from tuner.recipe import Recipe

__all__ = ["tune"]

MAX_UNMEASURED_IN_A_ROW = 25
"""Proposals in a row that are duplicates or skipped before the session decides the space is exhausted."""

POLL_S = 1.0
"""How often a session waiting on other workers' trials looks at the study again."""

SETUP_WAIT_S = 600.0
"""How long a session waits for the worker that created a new study to profile and seed it."""

Notify = Callable[[str], None]


def tune(
    recipe: Recipe,
    *,
    n_trials: int | None = None,
    search_only: bool = False,
    use_planner: bool = True,
    on_trial: Callable[[TrialEvent], None] | None = None,
    on_note: Notify | None = None,
    handle_signals: bool = True,
) -> SessionSummary:
    """Run one tuning session of ``recipe`` and decide whether to promote its best policy; the summary, whose
    ``exit_code`` is what ``recompute-tune`` exits with (a `RecomputeError` when the recipe cannot be tuned).

    ``n_trials``: the trials the *study* should have measured when this session stops (default: the recipe's
    ``search.n_trials``; a resumed study only runs the rest); ``search_only``: report the best without the gate;
    ``use_planner``: profile and plan when this session sets the study up (else: baselines only).
    """
    if n_trials is not None and (not isinstance(n_trials, int) or n_trials < 1):
        raise RecomputeError(f"n_trials: must be a positive integer, got {n_trials!r}")
    notify = on_note or (lambda _msg: None)
    interrupts = Interrupts(notify)
    with interrupts.installed() if handle_signals else contextlib.nullcontext(interrupts):
        n = n_trials or recipe.search.n_trials
        return _TuningSession(recipe, notify, interrupts, n, search_only, use_planner, on_trial).run()


class _TuningSession:
    """The state of one `tune` call (kept off module level: several may run in one process)."""

    study: TuningStudy  # opened first thing in `run`
    planned: PlannerSeeds  # the setup's: its planner predicts each candidate
    tracker: Tracker  # opened once the study is set up

    def __init__(
        self,
        recipe: Recipe,
        notify: Notify,
        interrupts: Interrupts,
        n_trials: int,
        search_only: bool,
        use_planner: bool,
        on_trial: Callable[[TrialEvent], None] | None,
    ) -> None:
        from tuner._preflight import check_settings
        from tuner._trials import device_info

        check_settings(recipe, output=not search_only)
        self.device, total = device_info(recipe)
        layers = inspect_layers(recipe)
        self.space = SearchSpace.for_layers(
            layers, recipe.search.modes, recipe.search.micro_batch_sizes, recipe.search.compile
        )
        self.budget = recipe.budget.limit_bytes(total)
        self.name = study_name(recipe, self.device)
        notify(f"recipe {recipe.name}: {len(layers)} layers on {self.device}; budget {recipe.budget.describe(total)}")
        notify(f"search space {self.space.describe()}")
        if (ranks := recipe.trainer.describe_ranks()) is not None:
            notify(ranks)
        self.recipe, self.notify, self.interrupts = recipe, notify, interrupts
        self.n_trials, self.search_only, self.use_planner, self.on_trial = n_trials, search_only, use_planner, on_trial
        self.notes: list[str] = []
        self.presence = Presence()
        self.session_run_id: str | None = None
        self.ran = 0
        self.grace = grace_s()
        self.jitter = random.Random()  # unseeded: two workers must not draw the same pause
        self.data_noted = False

    def note(self, message: str) -> None:
        self.notes.append(message)
        self.notify(message)

    def run(self) -> SessionSummary:
        recipe = self.recipe
        heartbeats: list[Heartbeat] = []
        try:
            self.study = self.presence.study = TuningStudy.open(
                name=self.name,
                storage=str(recipe.study.storage),
                space=self.space,
                budget_bytes=self.budget,
                seed=recipe.search.seed,
                recipe=recipe.name,
                recipe_fingerprint=recipe.fingerprint(),
                device=self.device,
            )
            heartbeats = [Heartbeat(self.presence.beat_study).start(), Heartbeat(self.presence.beat_tracker).start()]
            self.planned = self._set_up(self.study)
            self.interrupts.phase = "between"
            self._open_session_run()
            stop_reason = self._search(self.study)
            if self.interrupts.stop.is_set():
                return self._finish_interrupted("stopped after the current trial")
            if stop_reason:
                self.note(stop_reason)
            return self._decide(self.study)
        except KeyboardInterrupt:
            return self._finish_interrupted("killed")
        except BaseException as err:
            # Leave nothing running after an unexpected error.
            with contextlib.suppress(Exception):
                if self.presence.in_flight is not None:
                    self.study.tell_interrupted(self.presence.in_flight, f"session failed: {type(err).__name__}: {err}")
                    self.presence.in_flight = None
            if self.presence.tracker is not None:
                with contextlib.suppress(Exception):
                    self.tracker.sessions.close("FAILED")
            failure = storage_failure(str(recipe.study.storage), err)
            if failure is not None:
                raise failure from err
            raise
        finally:
            for heartbeat in heartbeats:
                heartbeat.stop()

    def _set_up(self, study: TuningStudy) -> PlannerSeeds:
        """Profile, plan and seed ``study`` once for all its workers, or wait for the worker doing it."""
        recipe, name, space, budget = self.recipe, self.name, self.space, self.budget
        if not study.created:
            if not study.study.user_attrs.get(StudyAttr.SEEDED):
                self.notify(f"study {name} is being set up by another worker; waiting ...")
            taken_over = study.wait_or_take_setup(SETUP_WAIT_S, self.grace)
            if taken_over is None:
                attrs = study.study.user_attrs
                if stored := attrs.get(StudyAttr.PROFILE):
                    seeding = plan_seeds(recipe, space, budget, stored=stored)
                else:
                    seeding = PlannerSeeds(
                        note=attrs.get(StudyAttr.PLANNER_NOTE) or "the study holds no profile; no predictions"
                    )
                if seeding.note:
                    self.note(seeding.note)
                self.notify(f"study {name} resumed: {study.ran_count()} trials run so far")
                return seeding
            self.note(f"taking over the study's setup: {taken_over}")
        self.presence.setting_up = True
        try:
            kill_point("profiling")  # a test hook; see tuner._liveness
            if self.use_planner:
                self.notify("profiling the model and planning ...")
                seeding = plan_seeds(recipe, space, budget)
            else:
                seeding = PlannerSeeds(note="planner not used (asked not to plan); seeding from baselines only")
            if seeding.profile is not None:
                study.study.set_user_attr(StudyAttr.PROFILE, seeding.profile.to_dict())
            if seeding.note:
                study.study.set_user_attr(StudyAttr.PLANNER_NOTE, seeding.note)
                self.note(seeding.note)
            enqueued = study.seed([*baseline_seeds(space), *seeding.seeds])
        except BaseException:
            study.abandon_setup()
            raise
        finally:
            self.presence.setting_up = False
        self.notify(f"study {name} created; seeded {', '.join(enqueued) or 'nothing'}")
        return seeding

    def _open_session_run(self) -> None:
        """Open the tracker and this session's run (resumed when an interrupted or dead session left one)."""
        from tuner._trials import clean_stale_trial_dirs

        recipe = self.recipe
        tracker = open_tracker(recipe.tracking.uri, str(recipe.tracking.experiment))
        # End KILLED a dead session's run first, so this session resumes it instead of opening another.
        end_dead_session_runs(tracker, self.name, self.grace, self.note)
        for done in tracker.registry.clean_leftovers(recipe.output, self.grace):
            self.note(done)
        self.session_run_id = tracker.sessions.start_session(recipe, study_name=self.name, resume=True)
        self.tracker = self.presence.tracker = tracker
        for folder in clean_stale_trial_dirs():
            self.notify(f"removed {folder}: its tuning process is gone")

    def _search(self, study: TuningStudy) -> str | None:
        """Ask, run and tell trials until the study has ``n_trials`` measured; why it stopped early."""
        n_trials, started, timeout = self.n_trials, time.monotonic(), self.recipe.search.timeout_s
        unmeasured = 0
        # By then every other worker's trial has ended by its deadline or been reaped as dead.
        wait_limit = self.recipe.trial.timeout_s + self.grace + 60.0
        waiting_since: float | None = None
        while True:
            self.interrupts.phase = "between"
            if self.interrupts.stop.is_set():
                return None
            reap(study, self.tracker, self.grace, self.note)
            if study.ran_count() >= n_trials:
                return None
            if timeout is not None and time.monotonic() - started >= timeout:
                return f"search.timeout_s ({timeout:g} s) reached"
            if unmeasured >= MAX_UNMEASURED_IN_A_ROW:
                return f"search space exhausted: {unmeasured} proposals in a row were duplicates or skipped"
            if others_fill(study, n_trials, self.grace):
                # Others' trials in flight make up n_trials: wait rather than run a surplus one.
                if waiting_since is None:
                    waiting_since = time.monotonic()
                    self.notify("n_trials are measured or being measured by other workers; waiting for them ...")
                if time.monotonic() - waiting_since > wait_limit:
                    return f"other workers' trials did not finish within {wait_limit:g} s; stopped waiting"
                self.interrupts.stop.wait(POLL_S)
                continue
            waiting_since = None
            ran = self._one_trial(study)
            unmeasured = 0 if ran == "measured" else unmeasured + 1
            kill_point("between" if ran == "measured" else "")  # a test hook; see tuner._liveness
            if ran == "stood down":
                # Another worker may have stood down too: a random pause makes one of them ask first.
                self.interrupts.stop.wait(self.jitter.uniform(0.0, POLL_S))

    def _one_trial(self, study: TuningStudy) -> Literal["measured", "not measured", "stood down"]:
        """One proposal: not measured when a duplicate or predicted far over budget."""
        from tuner._trials import TrialResult, run_trial

        proposal = study.ask(session_run_id=self.session_run_id)
        self.presence.in_flight = proposal

        def log(result: TrialResult, reason: str | None) -> str:
            pred = proposal.prediction.figures() if proposal.prediction is not None else None
            layers, mb = list(self.space.layer_names), proposal.micro_batch
            return self.tracker.sessions.log_trial(proposal.number, proposal.policy, layers, mb, result, pred, reason)

        stand_down = stand_down_reason(study, proposal, self.n_trials, self.grace)
        if stand_down is not None:
            log(TrialResult.skipped(stand_down, device=self.device), stand_down)
            self._event(study.tell_interrupted(proposal, stand_down).number)
            return "stood down"
        if proposal.duplicate_of is not None:
            reason = f"duplicate of trial {proposal.duplicate_of.number} (same policy and micro-batch)"
            run_id = log(TrialResult.skipped(reason, device=self.device), reason)
            self._event(study.tell_duplicate(proposal, run_id=run_id).number)
            return "not measured"
        study.claim(proposal)
        proposal.prediction = self.planned.predict(proposal.policy, proposal.micro_batch)
        skip = far_over_budget(proposal.prediction, self.budget)
        if skip is not None:
            run_id = log(TrialResult.skipped(skip, device=self.device), skip)
            self._event(study.tell_skipped(proposal, skip, run_id=run_id).number)
            return "not measured"
        with self.interrupts.during("trial"):
            result = run_trial(self.recipe, proposal.policy, micro_batch=proposal.micro_batch, budget_bytes=self.budget)
        if not self.data_noted and result.batches and result.batches.get("varies"):
            from tuner._trials.batches import BatchScan

            self.data_noted = True
            self.note(f"data: {BatchScan(**result.batches).describe()}")
        frozen = study.tell_result(proposal, result, run_id=log(result, None))
        self.ran += 1
        self._event(frozen.number)
        return "measured"

    def _event(self, number: int) -> None:
        self.presence.in_flight = None
        if self.on_trial is None:
            return
        records = self.study.records()
        self.on_trial(
            TrialEvent(
                record=next(r for r in records if r.number == number),
                best=best_of(records),
                ran=sum(1 for r in records if r.ran),
                n_trials=self.n_trials,
                budget_bytes=self.budget,
                layer_names=self.space.layer_names,
            )
        )

    def _summary(
        self, status: str, exit_code: int, race: RaceResult | None = None, chosen: str | None = None
    ) -> SessionSummary:
        return summarize(
            self.recipe,
            self.presence.study,
            status,
            exit_code,
            study=self.name,
            device=self.device,
            budget_bytes=self.budget,
            space=self.space,
            ran=self.ran,
            session_run_id=self.session_run_id,
            notes=self.notes,
            race=race,
            chosen=chosen,
        )

    def _finish(self, status: str, summary: SessionSummary) -> SessionSummary:
        """Close the session run; when FINISHED, first restore the good policy from MLflow into the output file."""
        if self.presence.tracker is None or self.session_run_id is None:
            return summary
        if status == "FINISHED":
            registry = self.tracker.registry
            restored = registry.restore_file(self.recipe.output)
            if restored is not None:
                self.note(f"policy file: {restored}")
            if summary.policy_path is None and registry.current_good() is not None:
                summary.policy_path = self.recipe.output
        # A dead worker's session run may have outlived its reaped trial's grace period: end it now.
        end_dead_session_runs(self.tracker, self.name, self.grace, self.note)
        sessions = self.tracker.sessions
        head = [f"study {self.name} ({summary.storage})", f"search space {summary.search_space}"]
        sessions.note_session([*head, f"status {summary.status}", *summary.notes])
        sessions.finish_session(
            status=status,
            best=None if summary.best is None else summary.best.to_dict(),
            trials_table=[r.to_dict() for r in summary.records],
            baselines={k: v.to_dict() for k, v in summary.baselines.items()},
            budget_bytes=self.budget,
        )
        return summary

    def _finish_interrupted(self, how: str) -> SessionSummary:
        # Handlers stay installed: a further Ctrl-C during this bookkeeping only sets the flag.
        self.interrupts.phase = "between"
        if self.presence.in_flight is not None:
            self.study.tell_interrupted(self.presence.in_flight, f"interrupted by the user ({how})")
            self.presence.in_flight = None
        self.note(f"interrupted ({how}); run the same command again to resume the study")
        return self._finish("KILLED", self._summary("interrupted", EXIT_INTERRUPTED))

    def _decide(self, study: TuningStudy) -> SessionSummary:
        if not self.search_only:
            timeout = float(self.recipe.trial.timeout_s) + 60.0
            wait_for_running(study, timeout, self.interrupts.stop, self.notify, self.note)
            if self.interrupts.stop.is_set():
                return self._finish_interrupted("stopped while waiting for other workers' trials")
        best = study.best()
        if best is None:
            summary = self._summary("infeasible", EXIT_INFEASIBLE)
            summary.reasons.append(why_infeasible(summary, self.budget))
            return self._finish("FINISHED", summary)
        if self.search_only:
            summary = self._summary("searched", EXIT_OK)
            summary.reasons.append("search only: best feasible trial reported, not gated or promoted")
            return self._finish("FINISHED", summary)
        return self._race_and_gate(study, best)

    def _race_and_gate(self, study: TuningStudy, best: TrialRecord) -> SessionSummary:
        """Race the study's leaders and gate the winner, under the study's gate lease: two races at once would
        measure each other. Without a new trial since the last decision the good policy stands unraced: racing
        again would only re-roll the noise that race settled."""
        from tuner._trials import check_numerics, run_race, run_trial

        killable, registry, layers = self.interrupts.stoppable, self.tracker.registry, self.space.layer_names
        wait_s = longest_s(self.recipe) + 60.0
        lease = gate_lease(study.storage, self.name, wait_s=wait_s, on_wait=self.notify, cancel=self.interrupts.stop)
        with lease as waited:
            good = registry.current_good()
            records = study.records()
            race: RaceResult | None = None
            if (self.ran == 0 or waited) and good is not None and good.micro_batch == best.micro_batch:
                why = "no new trial since the last decision"
                if waited:
                    why = "another worker decided while this one waited"
                self.note(f"race: not run: {why}; the current good policy stands")
                chosen: str | None = good.fingerprint
                candidate = Candidate(good.policy, good.micro_batch, good.run_id, layers)
            else:
                race = self._race(best, good, records)
                candidate = candidate_of(best, race, good, records, layers)
                chosen = race.winner if race is not None and race.ok else None
            self.notify(f"gate: {candidate.policy.short(layers)} is the candidate")
            decision = decide(
                self.tracker,
                candidate,
                recipe=self.recipe,
                budget_bytes=self.budget,
                run_trial=killable(run_trial),
                check_numerics=killable(check_numerics),
                run_race=killable(run_race),
                race=race,
                progress=self.notify,
            )
        if waited and decision.unchanged:
            decision.reasons.append("another worker ran the gate for this study while this one waited")
        status = "current" if decision.unchanged else "promoted" if decision.promoted else "rejected"
        summary = self._summary(status, EXIT_INFEASIBLE if status == "rejected" else EXIT_OK, race, chosen)
        good = registry.current_good()
        summary.tuned_for = good.policy.tuned_for if good is not None else None
        summary.reasons.extend(decision.reasons)
        summary.evidence = dict(decision.evidence)
        summary.decision_run_id = decision.decision_run_id
        return self._finish("FINISHED", summary)

    def _race(self, best: TrialRecord, good: GoodPolicy | None, records: list[TrialRecord]) -> RaceResult | None:
        """Race the leading candidates; ``None`` when the recipe turns the race off."""
        from lightning_recompute.race import RaceResult
        from tuner._trials import run_race

        recipe, budget = self.recipe, self.budget
        if not recipe.race.enabled:
            self.note("race: off in the recipe; the best single trial is gated and no 'vs' figure is given")
            return None
        # The search's cost sets the race's: a race of a fixed length would double a short search.
        search_s = sum(r.wall_s for r in records if r.ran and r.wall_s is not None)
        plan = recipe.race_plan(search_s=search_s)
        entry = choose_field(records, best, good, leaders=plan.leaders, predicted=plan.predicted, budget_bytes=budget)
        for line in entry.notes:
            self.note(f"race: {line}")
        if recipe.trainer.devices > 1 or recipe.trainer.num_nodes > 1:
            entry.skipped = "multi-device trials are not raced yet (one process races on one device)"
        if entry.skipped is not None:
            self.note(f"race: not run: {entry.skipped}")
            return RaceResult(outcome="skipped", reason=entry.skipped)
        layers = self.space.layer_names
        names = ", ".join(f"{p.short(layers)} ({' = '.join(labels)})" for p, labels in entry.entrants)
        self.notify(f"race: {len(entry.entrants)} candidates interleaved in one process: {names} ...")
        if plan.total_s is not None and plan.share is not None:
            by_share = plan.share * search_s
            share = f"{plan.share:.0%} of the search's {search_s:.0f} s of trials"
            if plan.total_s > by_share:
                why = f"the race's floor of {plan.min_s:.0f} s; race.share's {share} would be {by_share:.0f} s"
            else:
                why = f"{share}, race.share"
            self.note(f"race: at most {plan.total_s:.0f} s of rounds ({why})")
        race = self.interrupts.stoppable(run_race)(
            recipe,
            entry.entrants,
            layer_names=layers,
            references=entry.references,
            micro_batch=entry.micro_batch,
            budget_bytes=budget,
            plan=plan,
        )
        if race.ok and race.winner is not None:
            race = race.calibrated({r.fingerprint: r.throughput for r in records if r.ran})
            won = race.entrants[race.winner].short if race.winner is not None else "?"
            self.notify(f"race: {won} won after {race.select_rounds} rounds ({race.stop})")
            for said in (*race.decision_lines(), *race.headlines()):
                if said:
                    self.notify(f"race: {said}")
        else:
            self.note(f"race: {race.outcome}: {race.reason}; the best single trial is gated")
        self.tracker.sessions.log_race(race)
        return race
