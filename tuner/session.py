"""One tuning session, the loop only: study -> trials -> tracking -> decision -> policy file.

`tune` is what ``recompute-tune RECIPE`` runs. It opens the study (`tuner._search`), has it set up
once (profile and plan: `tuner._search.planner_seeds`), asks, runs (`tuner._trials`) and tells trials,
records each in MLflow (`tuner._tracking`), and hands the best feasible one to `tuner._decision` (the
race and the evidence gate). What workers sharing the study agree on is `tuner._workers`'. It returns
a `tuner.summary.SessionSummary` and reports progress through callbacks, so the CLI only parses
arguments and prints.

Interrupts (`tuner._interrupts`): the first Ctrl-C lets the trial in flight finish, records it,
and stops; the second kills the trial (its process group) and records it as interrupted. Either
way the in-flight Optuna trial is told (FAIL, and a seed goes back in the queue), the MLflow
session run is ended as KILLED, and the next run of the same recipe resumes the study. Setting
up (profiling) and the evidence gate are stopped by the first Ctrl-C: nothing is promoted from an
interrupted confirmation.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from lightning_recompute.errors import RecomputeError
from tuner._decision import Stage, decide_best
from tuner._interrupts import Interrupts
from tuner._liveness import Heartbeat, grace_s, kill_point
from tuner._search import (
    Predictor,
    Proposal,
    SearchSpace,
    TuningStudy,
    baseline_seeds,
    best_of,
    far_over_budget,
    inspect_layers,
    study_name,
)
from tuner._search.planner_seeds import PlannerSeeds, plan_seeds
from tuner._stores import storage_failure
from tuner._tracking import open_tracker
from tuner._workers import (
    Presence,
    end_dead_session_runs,
    join_setup,
    others_fill,
    reap,
    stand_down_reason,
    wait_for_running,
)
from tuner.exits import EXIT_INFEASIBLE, EXIT_INTERRUPTED, EXIT_OK
from tuner.summary import SessionSummary, TrialEvent, summarize, why_infeasible

if TYPE_CHECKING:
    from lightning_recompute.race import RaceResult
    from tuner._search import SearchSpace, TuningStudy
    from tuner._tracking import Tracker
    from tuner._trials import TrialResult
    from tuner._workers import Presence
    from tuner.recipe import Recipe
    from tuner.summary import SessionSummary

__all__ = ["tune"]


_log = logging.getLogger(__name__)


MAX_UNMEASURED_IN_A_ROW = 25
"""Proposals in a row that are duplicates or skipped before the session decides the space is exhausted."""

POLL_S = 1.0
"""How often a session waiting on other workers' trials looks at the study again."""

Notify = Callable[[str], None]


# ---------------------------------------------------------------------------------------------- tune


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
    """Run one tuning session of ``recipe`` and decide whether to promote its best policy.

    Args:
        recipe: a loaded recipe (`tuner.recipe._load`).
        n_trials: how many trials the *study* should have measured when this session stops
            (default: the recipe's ``search.n_trials``); a resumed study only runs the rest.
        search_only: search, then report the best without the gate or a promotion (workers
            sharing a study; the last run gates).
        use_planner: profile the model and plan when this session sets the study up (seeds
            from the planner, planner-predicted hopeless candidates skipped). Without it the
            study is seeded with the baselines only; a profile already in the study is still used.
        on_trial: called after every trial with what the CLI prints.
        on_note: called with one-line progress notes.
        handle_signals: install the Ctrl-C handling described in the module docstring.

    Returns:
        The summary; its ``exit_code`` is what ``recompute-tune`` exits with.

    Raises:
        RecomputeError: the recipe cannot be tuned as written (layers not found, study clash ...).
    """
    if n_trials is not None and (not isinstance(n_trials, int) or n_trials < 1):
        raise RecomputeError(f"n_trials: must be a positive integer, got {n_trials!r}")
    notify = on_note or (lambda _msg: None)
    interrupts = Interrupts(notify)
    guard = interrupts.installed() if handle_signals else contextlib.nullcontext(interrupts)
    with guard:
        where = _Where.of(recipe, search_only, notify)
        options = _Options(n_trials or recipe.search.n_trials, search_only, use_planner, on_trial)
        return _TuningSession(recipe, where, options, notify, interrupts).run()


@dataclass(frozen=True)
class _Where:
    """What a session tunes for, found before it opens anything: the device, its budget, the space, the study's name."""

    device: str
    budget: int
    space: SearchSpace
    name: str

    @classmethod
    def of(cls, recipe: Recipe, search_only: bool, notify: Notify) -> _Where:
        from tuner._preflight import check_settings
        from tuner._trials import device_info

        # Before anything is measured: a path or URI that cannot work fails now, not after the search.
        check_settings(recipe, output=not search_only)
        device, total = device_info(recipe)
        layers = inspect_layers(recipe)
        space = SearchSpace.for_layers(
            layers, recipe.search.modes, recipe.search.micro_batch_sizes, recipe.search.compile
        )
        where = cls(
            device=device, budget=recipe.budget.limit_bytes(total), space=space, name=study_name(recipe, device)
        )
        notify(f"recipe {recipe.name}: {len(layers)} layers on {device}; budget {recipe.budget.describe(total)}")
        notify(f"search space {space.describe()}")
        ranks = recipe.trainer.describe_ranks()
        if ranks is not None:
            notify(ranks)
        return where


@dataclass(frozen=True)
class _Options:
    """How `tune` was asked to run (its keyword arguments)."""

    n_trials: int
    search_only: bool
    use_planner: bool
    on_trial: Callable[[TrialEvent], None] | None


class _TuningSession:
    """The state of one `tune` call (kept off module level: several may run in one process).

    The loop only: set the study up, ask / run / tell trials, then hand the best to `tuner._decision`.
    Workers sharing the study are `tuner._workers`' concern; the decision, `tuner._decision`'s.
    """

    def __init__(
        self, recipe: Recipe, where: _Where, options: _Options, notify: Notify, interrupts: Interrupts
    ) -> None:
        self.recipe = recipe
        self.where = where
        self.options = options
        self.notify = notify
        self.interrupts = interrupts
        self.notes: list[str] = []
        self.presence = Presence()
        self.session_run_id: str | None = None
        self.seeding: PlannerSeeds | None = None
        self.predict: Predictor | None = None
        self.ran = 0
        self.grace = grace_s()
        self.jitter = random.Random()
        """The random pause after standing down (unseeded: two workers must not draw the same)."""
        self.data_noted = False
        """Whether the session said that the data module's batches vary (once, at the first trial that saw it)."""

    @property
    def study(self) -> TuningStudy | None:
        return self.presence.study

    @property
    def tracker(self) -> Tracker | None:
        return self.presence.tracker

    def _tracker(self) -> Tracker:
        """The session's tracker; only called once `run` has opened it."""
        if self.tracker is None:
            raise RuntimeError("the tracker is used before the session opened it")
        return self.tracker

    def note(self, message: str) -> None:
        self.notes.append(message)
        self.notify(message)

    # -------------------------------------------------------------- the flow

    def run(self) -> SessionSummary:
        recipe, where = self.recipe, self.where
        heartbeats: list[Heartbeat] = []
        try:
            self.presence.study = TuningStudy.open(
                name=where.name,
                storage=str(recipe.study.storage),
                space=where.space,
                budget_bytes=where.budget,
                seed=recipe.search.seed,
                recipe=recipe.name,
                recipe_fingerprint=recipe.fingerprint(),
                device=where.device,
            )
            heartbeats = [Heartbeat(self.presence.beat_study).start(), Heartbeat(self.presence.beat_tracker).start()]
            self.seeding = _set_up_study(
                self.presence.study,
                where.name,
                recipe,
                where.space,
                where.budget,
                use_planner=self.options.use_planner,
                presence=self.presence,
                grace_s=self.grace,
                notify=self.notify,
                note=self.note,
            )
            self.predict = self.seeding.predictor()
            self.interrupts.phase = "between"
            self.presence.tracker, self.session_run_id = _open_session_run(
                recipe, where.name, self.grace, self.notify, self.note
            )
            stop_reason = self._search()
            if self.interrupts.stop.is_set():
                return self._finish_interrupted("stopped after the current trial")
            if stop_reason:
                self.note(stop_reason)
            return self._decide()
        except KeyboardInterrupt:
            return self._finish_interrupted("killed")
        except BaseException as err:
            self._finish_failed(err)
            failure = storage_failure(str(recipe.study.storage), err)
            if failure is not None:
                raise failure from err
            raise
        finally:
            for heartbeat in heartbeats:
                heartbeat.stop()

    def _finish_failed(self, err: BaseException) -> None:
        """Leave nothing running after an unexpected error: the trial told FAIL, the session run FAILED."""
        why = f"session failed: {type(err).__name__}: {err}"
        presence = self.presence
        with contextlib.suppress(Exception):
            if presence.in_flight is not None and self.study is not None:
                self.study.tell_interrupted(presence.in_flight, why)
                presence.in_flight = None
        with contextlib.suppress(Exception):
            if self.study is not None and self.seeding is None and presence.setting_up:
                self.study.setup.abandon()
        if self.tracker is not None:
            with contextlib.suppress(Exception):
                self.tracker.sessions.close("FAILED")

    def _search(self) -> str | None:
        """Ask, run and tell trials until the study has ``n_trials`` measured; why it stopped early."""
        study = self.study
        assert study is not None
        n_trials, started, timeout = self.options.n_trials, time.monotonic(), self.recipe.search.timeout_s
        unmeasured = 0
        # Waiting on other workers' trials ends at the latest when each could have timed out and
        # been found dead: a live worker's trial ends by its deadline, a dead one's is reaped.
        wait_limit = self.recipe.trial.timeout_s + self.grace + 60.0
        waiting_since: float | None = None
        while True:
            self.interrupts.phase = "between"
            if self.interrupts.stop.is_set():
                return None
            reap(study, self._tracker(), self.grace, self.where.space.layer_names, self.where.name, self.note)
            if study.ran_count() >= n_trials:
                return None
            if timeout is not None and time.monotonic() - started >= timeout:
                return f"search.timeout_s ({timeout:g} s) reached"
            if unmeasured >= MAX_UNMEASURED_IN_A_ROW:
                return f"search space exhausted: {unmeasured} proposals in a row were duplicates or skipped"
            if others_fill(study, n_trials, self.grace):
                # Other workers' trials in flight make up n_trials: wait for them rather than run
                # a surplus one. If one of them dies its candidate comes back, and this worker runs it.
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
                # Another worker asked at the same moment and may have stood down too: a random
                # pause makes one of the two ask first next time.
                self.interrupts.stop.wait(self.jitter.uniform(0.0, POLL_S))

    def _one_trial(self, study: TuningStudy) -> Literal["measured", "not measured", "stood down"]:
        """One proposal: measured, not measured (a duplicate, or skipped on the planner's prediction), or
        stood down for another worker's trial asked at the same moment."""
        from tuner._trials import TrialResult, run_trial

        proposal = study.ask(session_run_id=self.session_run_id)
        self.presence.in_flight = proposal
        device = self.where.device
        stand_down = stand_down_reason(study, proposal, self.options.n_trials, self.grace)
        if stand_down is not None:
            # A seed goes back in the queue, as for an interrupted trial.
            self._log(proposal, TrialResult.skipped(stand_down, device=device), stand_down)
            self._event(study.tell_interrupted(proposal, stand_down).number)
            return "stood down"
        if proposal.duplicate_of is not None:
            reason = f"duplicate of trial {proposal.duplicate_of.number} (same policy and micro-batch)"
            run_id = self._log(proposal, TrialResult.skipped(reason, device=device), reason)
            self._event(study.tell_duplicate(proposal, run_id=run_id).number)
            return "not measured"
        study.claim(proposal)
        if self.predict is not None:
            proposal.prediction = self.predict(proposal.policy, proposal.micro_batch)
        skip = far_over_budget(proposal.prediction, self.where.budget)
        if skip is not None:
            run_id = self._log(proposal, TrialResult.skipped(skip, device=device), skip)
            self._event(study.tell_skipped(proposal, skip, run_id=run_id).number)
            return "not measured"
        with self.interrupts.during("trial"):
            result = run_trial(
                self.recipe, proposal.policy, micro_batch=proposal.micro_batch, budget_bytes=self.where.budget
            )
        self._say_data(result)
        run_id = self._log(proposal, result, None)
        frozen = study.tell_result(proposal, result, run_id=run_id)
        self.ran += 1
        self._event(frozen.number)
        return "measured"

    def _say_data(self, result: TrialResult) -> None:
        """Say once that the data module's batches vary, and which batch the trials measure."""
        if self.data_noted or not result.batches or not result.batches.get("varies"):
            return
        from tuner._trials.batches import BatchScan

        self.data_noted = True
        self.note(f"data: {BatchScan(**result.batches).describe()}")

    def _log(self, proposal: Proposal, result: TrialResult, reason: str | None) -> str | None:
        pred = proposal.prediction.figures() if proposal.prediction is not None else None
        return self._tracker().sessions.log_trial(
            proposal.number,
            proposal.policy,
            list(self.where.space.layer_names),
            proposal.micro_batch,
            result,
            pred,
            reason=reason,
        )

    def _event(self, number: int) -> None:
        self.presence.in_flight = None
        if self.options.on_trial is None or self.study is None:
            return
        self.options.on_trial(_trial_event(self.study, number, self.options.n_trials, self.where))

    # -------------------------------------------------------------- endings

    def _summary(
        self, status: str, exit_code: int, race: RaceResult | None = None, chosen: str | None = None
    ) -> SessionSummary:
        where = self.where
        return summarize(
            self.recipe,
            self.study,
            status,
            exit_code,
            study=where.name,
            device=where.device,
            budget_bytes=where.budget,
            space=where.space,
            ran=self.ran,
            session_run_id=self.session_run_id,
            notes=self.notes,
            race=race,
            chosen=chosen,
        )

    def _finish_tracking(self, status: str, summary: SessionSummary) -> None:
        if self.tracker is not None and self.session_run_id is not None:
            # A worker that died mid-trial had its trial reaped once its trial's heartbeat was past the
            # grace period, but its session run's heartbeat may still have been within it then: end it
            # now, so that no session run is left RUNNING that no process runs.
            end_dead_session_runs(self.tracker, self.where.name, self.grace, self.note)
            _close_session_run(self.tracker, summary, status, study=self.where.name, budget_bytes=self.where.budget)

    def _finish_interrupted(self, how: str) -> SessionSummary:
        # Handlers stay installed: a further Ctrl-C during this bookkeeping only sets the flag.
        self.interrupts.phase = "between"
        if self.presence.in_flight is not None and self.study is not None:
            self.study.tell_interrupted(self.presence.in_flight, f"interrupted by the user ({how})")
            self.presence.in_flight = None
        self.note(f"interrupted ({how}); run the same command again to resume the study")
        summary = self._summary("interrupted", EXIT_INTERRUPTED)
        self._finish_tracking("KILLED", summary)
        return summary

    def _finish(self, summary: SessionSummary) -> SessionSummary:
        """Make the output file hold the good policy (restored from MLflow when it does not, and said so)
        and close the session run."""
        _reconcile_policy_file(self._tracker(), self.recipe.output, summary, self.note)  # notes: summary.notes
        self._finish_tracking("FINISHED", summary)
        return summary

    def _decide(self) -> SessionSummary:
        """Gate the best feasible trial against the current good policy (`tuner._decision`); promote or keep."""
        study = self.study
        if not self.options.search_only and study is not None:
            timeout = float(self.recipe.trial.timeout_s) + 60.0
            wait_for_running(study, timeout, self.interrupts.stop, self.notify, self.note)
            if self.interrupts.stop.is_set():
                return self._finish_interrupted("stopped while waiting for other workers' trials")
        best = study.best() if study is not None else None
        if best is None:
            summary = self._summary("infeasible", EXIT_INFEASIBLE)
            summary.reasons.append(why_infeasible(summary, self.where.budget))
            return self._finish(summary)
        if self.options.search_only:
            summary = self._summary("searched", EXIT_OK)
            summary.reasons.append("search only: best feasible trial reported, not gated or promoted")
            return self._finish(summary)
        stage = Stage(
            recipe=self.recipe,
            layer_names=self.where.space.layer_names,
            budget=self.where.budget,
            study_name=self.where.name,
            tracker=self._tracker(),
            session_run_id=self.session_run_id,
            notify=self.notify,
            note=self.note,
            killable=self.interrupts.stoppable,
            stop=self.interrupts.stop,
        )
        done = decide_best(stage, best, study, new_trials=self.ran > 0)
        decision = done.decision
        summary = self._summary(*done.status(), race=done.race, chosen=done.chosen)
        good = self._tracker().registry.current_good()
        summary.policy_path = self.recipe.output if (decision.promoted or good) else None
        summary.tuned_for = good.policy.tuned_for if good is not None else None
        summary.reasons.extend(decision.reasons)
        summary.evidence = dict(decision.evidence)
        summary.decision_run_id = decision.decision_run_id
        return self._finish(summary)


def _trial_event(study: TuningStudy, number: int, n_trials: int, where: _Where) -> TrialEvent:
    """What ``on_trial`` hears after trial ``number``: its record, the best so far and the count ran."""
    records = study.records()
    return TrialEvent(
        record=next(r for r in records if r.number == number),
        best=best_of(records),
        ran=sum(1 for r in records if r.ran),
        n_trials=n_trials,
        budget_bytes=where.budget,
        layer_names=where.space.layer_names,
    )


# -------------------------------------------------------------------------------- setup
# A study's setup, once for all its workers: profile the model, plan, store the profile and seed the study.

Say = Callable[[str], None]


def _set_up_study(
    study: TuningStudy,
    name: str,
    recipe: Recipe,
    space: SearchSpace,
    budget_bytes: int,
    *,
    use_planner: bool,
    presence: Presence,
    grace_s: float,
    notify: Say,
    note: Say,
) -> PlannerSeeds:
    """Set ``study`` up, or join it; the planner's predictions and notes either way.

    Args:
        study: the study, just opened; name: its name (for the messages).
        recipe, space, budget_bytes: what the planner plans for.
        use_planner: profile and plan (else the study is seeded with the baselines only).
        presence: the worker's heartbeat state; it holds the setup while this worker sets it up.
        grace_s: how long another host's worker may stay silent before it counts as dead.
        notify: progress (printed, not kept); note: a decision along the way (kept).

    Returns:
        The seeding: its predictor serves the whole session; its seeds are empty when the study was
        set up by another session (they are already in the study).
    """
    if not join_setup(study, name, grace_s, notify, note):
        stored = study.setup.profile()
        seeding = (
            plan_seeds(recipe, space, budget_bytes, stored=stored)
            if stored
            else PlannerSeeds(note=study.setup.planner_note() or "the study holds no profile; no predictions")
        )
        seeding.seeds = []  # the study was seeded by the session that set it up
        if seeding.note:
            note(seeding.note)
        notify(f"study {name} resumed: {study.ran_count()} trials run so far")
        return seeding
    presence.setting_up = True
    try:
        kill_point("profiling")  # a test hook; see tuner._liveness
        if use_planner:
            notify("profiling the model and planning ...")
            seeding = plan_seeds(recipe, space, budget_bytes)
        else:
            seeding = PlannerSeeds(note="planner not used (asked not to plan); seeding from baselines only")
        if seeding.profile is not None:
            study.setup.store_profile(seeding.profile.to_dict())
        if seeding.note:
            study.setup.store_planner_note(seeding.note)
            note(seeding.note)
        enqueued = study.seed([*baseline_seeds(space), *seeding.seeds])
    except BaseException:
        study.setup.abandon()
        raise
    finally:
        presence.setting_up = False
    notify(f"study {name} created; seeded {', '.join(enqueued) or 'nothing'}")
    return seeding


# -------------------------------------------------------------------------------- session_run
# The session's MLflow run, opened and closed, and the policy file reconciled with what MLflow records.


def _open_session_run(recipe: Recipe, study: str, grace_s: float, notify: Say, note: Say) -> tuple[Tracker, str]:
    """The tracker and this session's run (resumed when an interrupted or dead session of ``study`` left one)."""
    from tuner._trials import clean_stale_trial_dirs

    tracker = open_tracker(recipe.tracking.uri, str(recipe.tracking.experiment))
    # A session SIGKILLed earlier left its session run RUNNING: end it KILLED first, so this
    # session resumes it (one study, one session run) instead of opening another.
    end_dead_session_runs(tracker, study, grace_s, note)
    for done in tracker.registry.clean_leftovers(recipe.output, grace_s):
        note(done)
    run_id = tracker.sessions.start_session(recipe, study_name=study, resume=True)
    for folder in clean_stale_trial_dirs():
        notify(f"removed {folder}: its tuning process is gone")
    return tracker, run_id


def _reconcile_policy_file(tracker: Tracker, output: Path, summary: SessionSummary, note: Say) -> None:
    """Make ``output`` hold the good policy (restored from MLflow when it does not, and said so), and
    point ``summary`` at it when there is a good policy."""
    restored = tracker.registry.restore_file(output)
    if restored is not None:
        note(f"policy file: {restored}")
    if summary.policy_path is None and tracker.registry.current_good() is not None:
        summary.policy_path = output


def _close_session_run(
    tracker: Tracker, summary: SessionSummary, status: str, *, study: str, budget_bytes: int
) -> None:
    """End the session run ``status`` (FINISHED, KILLED) with the session's notes, trials table and baselines."""
    notes = [
        f"study {study} ({summary.storage})",
        f"search space {summary.search_space}",
        f"status {summary.status}",
        *summary.notes,
    ]
    tracker.sessions.note_session(notes)
    tracker.sessions.finish_session(
        status=status,
        best=None if summary.best is None else summary.best.to_dict(),
        trials_table=[r.to_dict() for r in summary.records],
        baselines={k: v.to_dict() for k, v in summary.baselines.items()},
        budget_bytes=budget_bytes,
    )
