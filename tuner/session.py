"""One tuning session, the loop only: study -> trials -> tracking -> gate -> policy file.

`tune` is what ``recompute-tune RECIPE`` runs. It opens the study (`tuner.search`), has it set up
once (profile and plan: `tuner.planner.seeds`), asks, runs (`tuner.trials`) and tells trials,
records each in MLflow (`tuner.tracking`), and hands the best feasible one to the evidence gate
(`tuner.gate`). It returns a `SessionSummary` and reports progress through callbacks, so the CLI
only parses arguments and prints.

Interrupts (`tuner.interrupts`): the first Ctrl-C lets the trial in flight finish, records it,
and stops; the second kills the trial (its process group) and records it as interrupted. Either
way the in-flight Optuna trial is told (FAIL, and a seed goes back in the queue), the MLflow
session run is ended as KILLED, and the next run of the same recipe resumes the study. Setting
up (profiling) and the evidence gate are stopped by the first Ctrl-C: nothing is promoted from an
interrupted confirmation.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from lightning_recompute.errors import RecomputeError
from lightning_recompute.tuned_for import TunedFor, batch_advice
from tuner.exits import EXIT_INFEASIBLE, EXIT_INTERRUPTED, EXIT_OK
from tuner.interrupts import Interrupts
from tuner.jsonable import jsonable
from tuner.killpoints import kill_point
from tuner.liveness import Heartbeat, grace_s
from tuner.planner.seeds import PlannerSeeds, plan_seeds
from tuner.recipe.build import data_batch_size
from tuner.search import (
    Predictor,
    Proposal,
    SearchSpace,
    TrialRecord,
    TuningStudy,
    baseline_seeds,
    best_of,
    far_over_budget,
    gate_lease,
    inspect_layers,
    study_name,
)
from tuner.stores import open_tracker, storage_failure

if TYPE_CHECKING:
    from tuner.gate import Candidate
    from tuner.race import RaceResult
    from tuner.recipe import Recipe
    from tuner.tracking import GoodPolicy, Tracker
    from tuner.trials import TrialResult

__all__ = ["SessionSummary", "TrialEvent", "training_change", "tune"]

_log = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")

MAX_UNMEASURED_IN_A_ROW = 25
"""Proposals in a row that are duplicates or skipped before the session decides the space is exhausted."""

SETUP_WAIT_S = 600.0
"""How long a worker joining a new study waits for the worker that created it to profile and seed it
(a dead creator is taken over at once on its host, after the grace period elsewhere)."""

POLL_S = 1.0
"""How often a session waiting on other workers' trials looks at the study again."""

Notify = Callable[[str], None]


# ---------------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class TrialEvent:
    """What the CLI prints for one trial as it finishes."""

    record: TrialRecord
    """The trial just told to Optuna (measured, skipped or duplicate)."""
    best: TrialRecord | None
    """The best feasible trial of the study so far (any worker's)."""
    measured: int
    """Trials measured in the study so far (what ``n_trials`` counts)."""
    n_trials: int
    budget_bytes: int
    layer_names: tuple[str, ...]


@dataclass
class SessionSummary:
    """What a tuning session did and decided; the CLI prints it, ``--format json`` dumps `to_dict`."""

    recipe: str
    study: str
    storage: str
    device: str
    budget_bytes: int
    layer_names: tuple[str, ...]
    search_space: str
    status: str
    """``promoted``, ``current`` (the best is already the good policy), ``searched`` (search only),
    ``rejected`` (the gate kept the current policy), ``infeasible`` or ``interrupted``."""
    exit_code: int
    trials_this_session: int = 0
    records: list[TrialRecord] = field(default_factory=list)
    """Every finished trial of the study, all sessions and workers."""
    best: TrialRecord | None = None
    baselines: dict[str, TrialRecord] = field(default_factory=dict)
    """Baseline name (``none``, ``full``, ``selective``, ``every_2nd_full``) -> its trial."""
    gains: dict[str, float | None] = field(default_factory=dict)
    """Baseline name -> the race winner's throughput over the baseline's, minus 1, from the race's
    estimation rounds (``None``: not raced against it; single trials are never compared)."""
    race: RaceResult | None = None
    """The race before the gate (``None``: not run; its ``reason`` says why when skipped or failed)."""
    chosen: bool = False
    """`best` is the race's winner (or the good policy a race chose before), not merely the fastest single trial."""
    reasons: list[str] = field(default_factory=list)
    """The gate's reasons, or why there was nothing to gate."""
    evidence: dict[str, Any] = field(default_factory=dict)
    policy_path: Path | None = None
    """The policy file written (on promotion) or holding the current good policy."""
    tracking_uri: str = ""
    experiment: str = ""
    session_run_id: str | None = None
    decision_run_id: str | None = None
    notes: list[str] = field(default_factory=list)
    """What the session decided along the way (planner unavailable, space exhausted ...)."""
    data_batch_size: int | None = None
    """The batch size of the recipe's data module (what ``micro_batch`` ``None`` means)."""
    tuned_for: TunedFor | None = None
    """What the good policy in `policy_path` was tuned for (``None``: no good policy, or one
    promoted before the tuner recorded it)."""

    @property
    def training_change(self) -> str | None:
        """What to set in the training job for the good policy to fit, in words (``None``: unknown)."""
        return training_change(self.tuned_for)

    @property
    def mlflow_command(self) -> str:
        """The command that browses this session in MLflow."""
        return f"mlflow ui --backend-store-uri {self.tracking_uri}"

    def vs_figures(self) -> dict[str, dict[str, Any]]:
        """Baseline name -> the race's figure against it: ``gain``, ``low``, ``high`` (fractions),
        ``rounds``, ``confidence`` and ``text`` (``+6.1% (95% CI +4.8..+7.3%, interleaved, 14 rounds)``)."""
        from tuner.race import format_gain

        out: dict[str, dict[str, Any]] = {}
        if self.race is None or not self.race.ok:
            return out
        for name, rec in self.baselines.items():
            iv = self.race.vs.get(rec.fingerprint)
            if iv is not None:
                gain, low, high = iv.gain()
                out[name] = {
                    "gain": gain,
                    "low": low,
                    "high": high,
                    "rounds": iv.rounds,
                    "confidence": iv.confidence,
                    "text": format_gain(iv),
                }
        return out

    @property
    def ranked(self) -> list[TrialRecord]:
        """Measured trials: feasible ones first, each group by throughput, highest first."""
        rows = [r for r in self.records if r.measured and r.throughput is not None]
        return sorted(rows, key=lambda r: (not r.feasible, -(r.throughput or 0.0), r.number))

    def to_dict(self) -> dict[str, Any]:
        """Plain types (JSON-ready)."""
        return {
            "recipe": self.recipe,
            "study": self.study,
            "storage": self.storage,
            "device": self.device,
            "budget_bytes": self.budget_bytes,
            "layer_names": list(self.layer_names),
            "search_space": self.search_space,
            "status": self.status,
            "exit_code": self.exit_code,
            "trials_this_session": self.trials_this_session,
            "best": None if self.best is None else self.best.to_dict(),
            "baselines": {k: v.to_dict() for k, v in self.baselines.items()},
            "gains": dict(self.gains),
            "vs": self.vs_figures(),
            "race": None if self.race is None else self.race.to_dict(),
            "chosen": self.chosen,
            "reasons": list(self.reasons),
            "evidence": jsonable(self.evidence),
            "policy_path": None if self.policy_path is None else str(self.policy_path),
            "tracking_uri": self.tracking_uri,
            "experiment": self.experiment,
            "mlflow_command": self.mlflow_command,
            "session_run_id": self.session_run_id,
            "decision_run_id": self.decision_run_id,
            "trials": [r.to_dict() for r in self.records],
            "notes": list(self.notes),
            "data_batch_size": self.data_batch_size,
            "tuned_for": None if self.tuned_for is None else self.tuned_for.to_dict(),
            "training_change": self.training_change,
        }


def training_change(tuned: TunedFor | None) -> str | None:
    """What a training job with the recipe's data must set for a policy tuned as ``tuned`` to fit.

    The batch a job feeds the model per step must not exceed the tuned micro-batch; gradient
    accumulation keeps the data's global batch (8 at micro-batch 4: ``batch_size=4,
    accumulate_grad_batches=2``).
    """
    if tuned is None or tuned.micro_batch is None:
        return None
    mb, data = tuned.micro_batch, tuned.data_batch_size
    if data is None:
        return f"train at batch_size={mb} per device (the micro-batch the policy was measured at) or smaller"
    if mb == data:
        return f"no change: the policy was tuned at the data's batch size of {data}"
    if mb < data:
        size, steps = batch_advice(mb, data)
        return (
            f"set batch_size={size}, accumulate_grad_batches={steps} in the training job to keep the global batch "
            f"of {data}; at batch size {data} the policy was not measured and may not fit the budget"
        )
    return (
        f"set batch_size={mb} in the training job (the policy was tuned at micro-batch {mb}, larger than the "
        f"data's {data}: a global batch of {mb}, so revisit the learning rate); at {data} it uses less memory "
        f"and fits too, but that is not the combination measured fastest"
    )


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
        recipe: a loaded recipe (`tuner.recipe.load`).
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
    notify = on_note or (lambda _msg: None)
    interrupts = Interrupts(notify)
    guard = interrupts.installed() if handle_signals else contextlib.nullcontext(interrupts)
    with guard:
        return _TuningSession(recipe, n_trials, search_only, use_planner, on_trial, notify, interrupts).run()


class _TuningSession:
    """The state of one `tune` call (kept off module level: several may run in one process)."""

    def __init__(
        self,
        recipe: Recipe,
        n_trials: int | None,
        search_only: bool,
        use_planner: bool,
        on_trial: Callable[[TrialEvent], None] | None,
        notify: Notify,
        interrupts: Interrupts,
    ) -> None:
        if n_trials is not None and (not isinstance(n_trials, int) or n_trials < 1):
            raise RecomputeError(f"n_trials: must be a positive integer, got {n_trials!r}")
        self.recipe = recipe
        self.n_trials = n_trials if n_trials is not None else recipe.search.n_trials
        self.search_only = search_only
        self.use_planner = use_planner
        self.on_trial = on_trial
        self.notify = notify
        self.interrupts = interrupts
        self.notes: list[str] = []
        self.study: TuningStudy | None = None
        self.tracker: Tracker | None = None
        self.session_run_id: str | None = None
        self.in_flight: Proposal | None = None
        self.seeding: PlannerSeeds | None = None
        self.predict: Predictor | None = None
        self.ran = 0
        self.setting_up = False
        """Whether this session holds the study's setup (its heartbeat keeps the setup owner alive)."""
        self.grace = grace_s()
        self.heartbeat: Heartbeat | None = None
        self.data_noted = False
        """Whether the session said that the data module's batches vary (once, at the first trial that saw it)."""

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
        from tuner.preflight import check_settings
        from tuner.trials import device_info

        recipe = self.recipe
        # Before anything is measured: a path or URI that cannot work fails now, not after the search.
        check_settings(recipe, output=not self.search_only)
        device, total = device_info(recipe)
        self.budget = recipe.budget.limit_bytes(total)
        layers = inspect_layers(recipe)
        self.space = SearchSpace.for_layers(
            layers, recipe.search.modes, recipe.search.micro_batch_sizes, recipe.search.compile
        )
        self.device = device
        self.name = study_name(recipe, device)
        self.notify(f"recipe {recipe.name}: {len(layers)} layers on {device}; budget {recipe.budget.describe(total)}")
        self.notify(f"search space {self.space.describe()}")
        ranks = recipe.trainer.describe_ranks()
        if ranks is not None:
            self.notify(ranks)
        try:
            self.study = TuningStudy.open(
                name=self.name,
                storage=str(recipe.study.storage),
                space=self.space,
                budget_bytes=self.budget,
                seed=recipe.search.seed,
                recipe=recipe.name,
                recipe_fingerprint=recipe.fingerprint(),
                device=device,
            )
            self.heartbeat = Heartbeat(self._beat).start()
            self.seeding = self._setup_study()
            self.predict = self.seeding.predictor()
            self.interrupts.phase = "between"
            self.tracker = open_tracker(recipe.tracking.uri, str(recipe.tracking.experiment))
            # A session SIGKILLed earlier left its session run RUNNING: end it KILLED first, so this
            # session resumes it (one study, one session run) instead of opening another.
            for run_id in self.tracker.end_dead_sessions(self.name, self.grace):
                self.note(f"session run {run_id} of a dead worker ended KILLED")
            for done in self.tracker.clean_leftovers(recipe.output, self.grace):
                self.note(done)
            self.session_run_id = self.tracker.start_session(recipe, study_name=self.name, resume=True)
            from tuner.trials import clean_stale_trial_dirs

            for folder in clean_stale_trial_dirs():
                self.notify(f"removed {folder}: its tuning process is gone")
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
            if self.heartbeat is not None:
                self.heartbeat.stop()

    def _beat(self) -> None:
        """One heartbeat (from the `Heartbeat` thread): the setup, the trial in flight, the session run."""
        study = self.study
        if study is None:
            return
        if self.setting_up:
            study.beat_setup()
        proposal = self.in_flight
        if proposal is not None:
            with contextlib.suppress(Exception):  # told meanwhile: a finished trial takes no heartbeat
                study.beat_trial(proposal)
        if self.tracker is not None:
            self.tracker.beat()

    def _reap(self) -> None:
        """Fail the trials of dead workers (their candidates go back in the queue) and record them in MLflow."""
        study, tracker = self.study, self._tracker()
        assert study is not None
        abandoned = study.reap_dead(self.grace)
        for dead in abandoned:
            tracker.log_abandoned_trial(
                dead.number,
                dead.policy,
                list(self.space.layer_names),
                dead.micro_batch,
                reason=dead.reason,
                session_run_id=dead.session_run_id,
            )
            self.note(f"trial {dead.number} failed: {dead.reason}; its candidate is queued again")
        if abandoned:
            for run_id in tracker.end_dead_sessions(self.name, self.grace):
                self.note(f"session run {run_id} of a dead worker ended KILLED")

    def _finish_failed(self, err: BaseException) -> None:
        """Leave nothing running after an unexpected error: the trial told FAIL, the session run FAILED."""
        why = f"session failed: {type(err).__name__}: {err}"
        with contextlib.suppress(Exception):
            if self.in_flight is not None and self.study is not None:
                self.study.tell_interrupted(self.in_flight, why)
                self.in_flight = None
        with contextlib.suppress(Exception):
            if self.study is not None and self.seeding is None and self.setting_up:
                self.study.abandon_setup()
        if self.tracker is not None:
            with contextlib.suppress(Exception):
                self.tracker.close("FAILED")

    def _setup_study(self) -> PlannerSeeds:
        """Profile, plan and seed the study once; reuse the stored profile when resuming or joining.

        The profile is kept in the study so a resumed session and every worker sharing the study
        predict with the same figures (and skip the same candidates) without profiling again.
        """
        study = self.study
        assert study is not None
        takes_over = study.created
        if not takes_over:
            if not study.seeded:
                self.notify(f"study {self.name} is being set up by another worker; waiting ...")
            takes_over = not study.wait_seeded(SETUP_WAIT_S, grace_s=self.grace)
            if takes_over:
                dead = study.setup_owner_dead(self.grace)
                self.note(f"taking over the study's setup: {dead or 'the worker setting it up gave up'}")
                study.take_over_setup()
        if not takes_over:
            stored = study.stored_profile()
            seeding = (
                plan_seeds(self.recipe, self.space, self.budget, stored=stored)
                if stored
                else PlannerSeeds(note=study.planner_note() or "the study holds no profile; no predictions")
            )
            seeding.seeds = []  # the study was seeded by the session that set it up
            if seeding.note:
                self.note(seeding.note)
            self.notify(f"study {self.name} resumed: {study.measured_count()} trials measured so far")
            return seeding
        self.setting_up = True
        try:
            kill_point("profiling")  # a test hook; see tuner.killpoints
            if self.use_planner:
                self.notify("profiling the model and planning ...")
                seeding = plan_seeds(self.recipe, self.space, self.budget)
            else:
                seeding = PlannerSeeds(note="planner not used (asked not to plan); seeding from baselines only")
            if seeding.profile is not None:
                study.store_profile(seeding.profile.to_dict())
            if seeding.note:
                study.store_planner_note(seeding.note)
                self.note(seeding.note)
            enqueued = study.seed([*baseline_seeds(self.space), *seeding.seeds])
        except BaseException:
            study.abandon_setup()
            raise
        finally:
            self.setting_up = False
        self.notify(f"study {self.name} created; seeded {', '.join(enqueued) or 'nothing'}")
        return seeding

    def _search(self) -> str | None:
        """Ask, run and tell trials until the study has ``n_trials`` measured; why it stopped early."""
        assert self.study is not None
        started = time.monotonic()
        timeout = self.recipe.search.timeout_s
        unmeasured = 0
        # Waiting on other workers' trials ends at the latest when each could have timed out and
        # been found dead: a live worker's trial ends by its deadline, a dead one's is reaped.
        wait_limit = self.recipe.trial.timeout_s + self.grace + 60.0
        waiting_since: float | None = None
        while True:
            self.interrupts.phase = "between"
            if self.interrupts.stop.is_set():
                return None
            self._reap()
            measured = self.study.measured_count()
            if measured >= self.n_trials:
                return None
            if timeout is not None and time.monotonic() - started >= timeout:
                return f"search.timeout_s ({timeout:g} s) reached"
            if unmeasured >= MAX_UNMEASURED_IN_A_ROW:
                return f"search space exhausted: {unmeasured} proposals in a row were duplicates or skipped"
            if measured + self.study.running_alive(self.grace) >= self.n_trials:
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
            ran = self._one_trial()
            unmeasured = 0 if ran else unmeasured + 1
            kill_point("between" if ran else "")  # a test hook; see tuner.killpoints

    def _one_trial(self) -> bool:
        """One proposal, run or not; whether it was measured."""
        from tuner.trials import TrialResult, run_trial

        study = self.study
        if study is None:
            raise RuntimeError("_one_trial called before the study was opened")
        proposal = study.ask(session_run_id=self.session_run_id)
        self.in_flight = proposal
        if study.measured_count() + study.running_alive(self.grace, below=proposal.number) >= self.n_trials:
            # Another worker asked at the same moment and holds the last slot (the lower number
            # wins): give this one back. A seed goes back in the queue, as for an interrupted trial.
            reason = "not run: other workers' trials make up n_trials"
            self._log(proposal, TrialResult.skipped(reason, device=self.device), reason)
            frozen = study.tell_interrupted(proposal, reason)
            self._event(frozen.number)
            return False
        if proposal.duplicate_of is not None:
            reason = f"duplicate of trial {proposal.duplicate_of.number} (same policy and micro-batch)"
            run_id = self._log(proposal, TrialResult.skipped(reason, device=self.device), reason)
            frozen = study.tell_duplicate(proposal, run_id=run_id)
            self._event(frozen.number)
            return False
        if self.predict is not None:
            proposal.prediction = self.predict(proposal.policy, proposal.micro_batch)
        skip = far_over_budget(proposal.prediction, self.budget)
        if skip is not None:
            run_id = self._log(proposal, TrialResult.skipped(skip, device=self.device), skip)
            frozen = study.tell_skipped(proposal, skip, run_id=run_id)
            self._event(frozen.number)
            return False
        self.interrupts.phase = "trial"
        try:
            result = run_trial(self.recipe, proposal.policy, micro_batch=proposal.micro_batch, budget_bytes=self.budget)
        finally:
            self.interrupts.phase = "between"
        if not self.data_noted and result.batches and result.batches.get("varies"):
            from tuner.trials.batches import BatchScan

            self.data_noted = True
            self.note(f"data: {BatchScan(**result.batches).describe()}")
        run_id = self._log(proposal, result, None)
        frozen = study.tell_result(proposal, result, run_id=run_id)
        self.in_flight = None
        self.ran += 1
        self._event(frozen.number)
        return True

    def _log(self, proposal: Proposal, result: TrialResult, reason: str | None) -> str | None:
        pred = proposal.prediction.figures() if proposal.prediction is not None else None
        return self._tracker().log_trial(
            proposal.number,
            proposal.policy,
            list(self.space.layer_names),
            proposal.micro_batch,
            result,
            pred,
            reason=reason,
        )

    def _event(self, number: int) -> None:
        self.in_flight = None
        if self.on_trial is None or self.study is None:
            return
        records = self.study.records()
        record = next(r for r in records if r.number == number)
        best = best_of(records)
        self.on_trial(
            TrialEvent(
                record=record,
                best=best,
                measured=sum(1 for r in records if r.measured),
                n_trials=self.n_trials,
                budget_bytes=self.budget,
                layer_names=self.space.layer_names,
            )
        )

    # -------------------------------------------------------------- endings

    def _summary(
        self, status: str, exit_code: int, race: RaceResult | None = None, chosen: str | None = None
    ) -> SessionSummary:
        records = self.study.records() if self.study is not None else []
        best = self.study.best() if self.study is not None else None
        if chosen is not None:
            # The race's winner (or the good policy it chose before) is the session's answer; its trial,
            # if a trial ran it, is the record shown.
            best = next((r for r in records if r.measured and r.fingerprint == chosen), best)
        baselines = _baselines(records)
        # "vs" figures come from the race's estimation rounds only: two single trials minutes apart
        # compare the machine's moments as much as the policies.
        gains: dict[str, float | None] = {}
        for name, rec in baselines.items():
            iv = race.vs.get(rec.fingerprint) if race is not None and race.ok else None
            gains[name] = iv.gain()[0] if iv is not None else None
        return SessionSummary(
            recipe=self.recipe.name,
            study=self.name,
            storage=str(self.recipe.study.storage),
            device=self.device,
            budget_bytes=self.budget,
            layer_names=self.space.layer_names,
            search_space=self.space.describe(),
            status=status,
            exit_code=exit_code,
            trials_this_session=self.ran,
            records=records,
            best=best,
            baselines=baselines,
            gains=gains,
            policy_path=None,
            tracking_uri=self.recipe.tracking.uri,
            experiment=str(self.recipe.tracking.experiment),
            session_run_id=self.session_run_id,
            notes=self.notes,
            data_batch_size=data_batch_size(self.recipe),
            race=race,
            chosen=chosen is not None and best is not None and best.fingerprint == chosen,
        )

    def _finish_tracking(self, status: str, summary: SessionSummary) -> None:
        if self.tracker is None or self.session_run_id is None:
            return
        # What the session decided without a trial (space, planner trouble, why it stopped) is
        # part of the record too: MLflow alone must explain the session.
        notes = [
            f"study {self.name} ({summary.storage})",
            f"search space {summary.search_space}",
            f"status {summary.status}",
            *summary.notes,
        ]
        self.tracker.note_session(notes)
        self.tracker.finish_session(
            status=status,
            best=None if summary.best is None else summary.best.to_dict(),
            trials_table=[r.to_dict() for r in summary.records],
            baselines={k: v.to_dict() for k, v in summary.baselines.items()},
            budget_bytes=self.budget,
        )

    def _finish_interrupted(self, how: str) -> SessionSummary:
        # Handlers stay installed: a further Ctrl-C during this bookkeeping only sets the flag.
        self.interrupts.phase = "between"
        if self.in_flight is not None and self.study is not None:
            self.study.tell_interrupted(self.in_flight, f"interrupted by the user ({how})")
            self.in_flight = None
        self.note(f"interrupted ({how}); run the same command again to resume the study")
        summary = self._summary("interrupted", EXIT_INTERRUPTED)
        self._finish_tracking("KILLED", summary)
        return summary

    def _decide(self) -> SessionSummary:
        """Gate the best feasible trial against the current good policy; promote or keep."""
        if not self.search_only:
            self._wait_for_other_workers()
            if self.interrupts.stop.is_set():
                return self._finish_interrupted("stopped while waiting for other workers' trials")
        best = self.study.best() if self.study is not None else None
        if best is None:
            summary = self._summary("infeasible", EXIT_INFEASIBLE)
            summary.reasons.append(_why_infeasible(summary, self.budget))
            self._check_policy_file(summary)
            self._finish_tracking("FINISHED", summary)
            return summary
        if self.search_only:
            summary = self._summary("searched", EXIT_OK)
            summary.reasons.append("search only: best feasible trial reported, not gated or promoted")
            self._check_policy_file(summary)
            self._finish_tracking("FINISHED", summary)
            return summary
        from tuner import gate
        from tuner.trials import check_numerics, run_race, run_trial

        if best.policy is None:
            raise RecomputeError(f"trial {best.number}: the study's record holds no policy to gate")
        tracker = self._tracker()
        # One gate at a time per study (`tuner.search.lease`): a worker that waited finds the
        # winner another worker promoted meanwhile already current, and records nothing twice.
        # The race runs under the same lease: two races at once would measure each other.
        trial_s = float(self.recipe.trial.timeout_s)
        settings = gate.GateSettings()
        wait_s = trial_s * (settings.confirm_factor + 3) + 3 * float(self.recipe.race.time_s) + 60.0
        storage = self.study.storage if self.study is not None else None
        with (
            gate_lease(storage, self.name, wait_s=wait_s, on_wait=self.notify, cancel=self.interrupts.stop)
            if storage is not None
            else contextlib.nullcontext(False)
        ) as waited:
            good = tracker.current_good()
            records = self.study.records() if self.study is not None else []
            if (self.ran == 0 or waited) and good is not None and good.micro_batch == best.micro_batch:
                # Nothing measured since the last decision, or another worker of this study raced and
                # gated the same finished study while this one waited: racing again would only re-roll
                # the noise that race settled. The good policy stands (and is gated as unchanged).
                race = None
                candidate = gate.Candidate(
                    policy=good.policy,
                    micro_batch=good.micro_batch,
                    source_run_id=good.run_id,
                    layer_names=self.space.layer_names,
                )
                chosen: str | None = good.fingerprint
                why = (
                    "another worker decided while this one waited" if waited else "no new trial since the last decision"
                )
                self.note(f"race: not run: {why}; the current good policy stands")
            else:
                race = self._race(best, good, records, self._killable(run_race))
                candidate = self._candidate(best, race, good, records)
                chosen = race.winner if race is not None and race.ok else None
            self.notify(f"gate: {candidate.policy.short(self.space.layer_names)} is the candidate")
            decision = gate.decide(
                tracker,
                candidate,
                recipe=self.recipe,
                budget_bytes=self.budget,
                output_path=self.recipe.output,
                run_trial=self._killable(run_trial),
                check_numerics=self._killable(check_numerics),
                run_race=self._killable(run_race),
                race=race,
                settings=settings,
                progress=self.notify,
            )
        if waited and decision.unchanged:
            decision.reasons.append("another worker ran the gate for this study while this one waited")
        if decision.unchanged:
            status, code = "current", EXIT_OK
        elif decision.promoted:
            status, code = "promoted", EXIT_OK
        else:
            status, code = "rejected", EXIT_INFEASIBLE
        summary = self._summary(status, code, race=race, chosen=chosen)
        good = tracker.current_good()
        summary.policy_path = self.recipe.output if (decision.promoted or good) else None
        summary.tuned_for = good.policy.tuned_for if good is not None else None
        summary.reasons.extend(decision.reasons)
        summary.evidence = dict(decision.evidence)
        summary.decision_run_id = decision.decision_run_id
        self._check_policy_file(summary)
        self._finish_tracking("FINISHED", summary)
        return summary

    def _race(
        self,
        best: TrialRecord,
        good: GoodPolicy | None,
        records: Sequence[TrialRecord],
        run_race: Callable[..., RaceResult],
    ) -> RaceResult | None:
        """Race the leading candidates (`tuner.race.field`); ``None`` when the recipe turns the race off."""
        from tuner.race import RaceResult
        from tuner.race.field import choose_field, suspects

        if not self.recipe.race.enabled:
            self.note("race: off in the recipe; the best single trial is gated and no 'vs' figure is given")
            return None
        entry = choose_field(records, best, good, leaders=self.recipe.race.leaders, budget_bytes=self.budget)
        for record, why in suspects(records):
            self.note(why)
            if record.feasible and record.policy is not None and record.micro_batch == best.micro_batch:
                entry.add(record.policy, f"suspect trial {record.number}")
        for note in entry.notes:
            self.note(f"race: {note}")
        if self.recipe.trainer.devices > 1 or self.recipe.trainer.num_nodes > 1:
            entry.skipped = "multi-device trials are not raced yet (one process races on one device)"
        if entry.skipped is not None:
            self.note(f"race: not run: {entry.skipped}")
            return RaceResult(outcome="skipped", reason=entry.skipped)
        names = ", ".join(f"{p.short(self.space.layer_names)} ({' = '.join(labels)})" for p, labels in entry.entrants)
        self.notify(f"race: {len(entry.entrants)} candidates interleaved in one process: {names} ...")
        race = run_race(
            self.recipe,
            entry.entrants,
            layer_names=self.space.layer_names,
            references=entry.references,
            micro_batch=entry.micro_batch,
            budget_bytes=self.budget,
        )
        if race.ok:
            race = race.calibrated({r.fingerprint: r.throughput for r in records if r.measured})
            self.notify(
                f"race: {race.entrants[race.winner].short} won after {race.select_rounds} rounds ({race.stop})"  # type: ignore[index]
            )
            for line in (race.tie_line(), race.unresolved_line(), *race.headlines()):
                if line:
                    self.notify(f"race: {line}")
        else:
            self.note(f"race: {race.outcome}: {race.reason}; the best single trial is gated")
        if self.tracker is not None and self.session_run_id is not None:
            self.tracker.log_race(race)
        return race

    def _candidate(
        self, best: TrialRecord, race: RaceResult | None, good: GoodPolicy | None, records: Sequence[TrialRecord]
    ) -> Candidate:
        """The gate's candidate: the race's winner, or without one the best single trial."""
        from tuner import gate

        policy, source = best.policy, best.run_id
        if race is not None and race.ok:
            won = next((r for r in records if r.measured and r.fingerprint == race.winner), None)
            if won is not None:
                policy, source = won.policy, won.run_id
            elif good is not None and good.fingerprint == race.winner:
                policy, source = good.policy, good.run_id
        assert policy is not None
        return gate.Candidate(
            policy=policy, micro_batch=best.micro_batch, source_run_id=source, layer_names=self.space.layer_names
        )

    def _wait_for_other_workers(self) -> None:
        """Wait until no trial of the study runs, so every worker gates the same final winner.

        Workers sharing a study stop at nearly the same time, but a trial another worker still
        runs may beat the best one seen now; gating before it ends would promote a winner that
        the next worker then replaces. Bounded by a trial's deadline (a dead worker's trial stays
        RUNNING until it is recovered); a Ctrl-C ends the wait.
        """
        if self.study is None:
            return
        deadline = time.monotonic() + float(self.recipe.trial.timeout_s) + 60.0
        told = False
        while (running := len(self.study.running())) and time.monotonic() < deadline:
            if not told:
                self.notify(f"gate: waiting for {running} trial(s) of other workers to finish ...")
                told = True
            if self.interrupts.stop.wait(1.0):
                return
        if running:
            self.note(f"{running} trial(s) of other workers still running after the wait; gating the best so far")

    def _check_policy_file(self, summary: SessionSummary) -> None:
        """Make the output file match the good policy (restored from MLflow when it does not), and say so."""
        tracker = self._tracker()
        restored = tracker.restore_file(self.recipe.output)
        if restored is not None:
            self.note(f"policy file: {restored}")  # summary.notes is this very list
        if summary.policy_path is None and tracker.current_good() is not None:
            summary.policy_path = self.recipe.output

    def _killable(self, fn: Callable[_P, _R]) -> Callable[_P, _R]:
        """``fn`` with the first Ctrl-C stopping it (the gate's measurements; not its records)."""

        def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            self.interrupts.phase = "gate"
            kill_point("gate")  # a test hook; see tuner.killpoints
            try:
                return fn(*args, **kwargs)
            finally:
                self.interrupts.phase = "between"

        return call


def _baselines(records: Sequence[TrialRecord]) -> dict[str, TrialRecord]:
    """Each baseline's trial: the measured one (a re-queued seed may have an interrupted record too),
    or, for a baseline that was a duplicate, the trial it duplicated."""
    by_number = {r.number: r for r in records}
    out: dict[str, TrialRecord] = {}
    for r in records:
        if not (r.seed or "").startswith("baseline:"):
            continue
        name = r.seed.split(":", 1)[1]  # type: ignore[union-attr]
        if r.outcome == "duplicate" and r.duplicate_of in by_number:
            r = by_number[r.duplicate_of]
        if r.outcome in ("interrupted", "abandoned"):
            out.setdefault(name, r)
            continue
        if name not in out or out[name].outcome in ("interrupted", "abandoned"):
            out[name] = r
    return out


def _why_infeasible(summary: SessionSummary, budget: int) -> str:
    """Why there is no best trial, consistent with the "N trials measured" count the report prints."""
    if summary.ranked:
        return f"no measured trial fits the budget limit of {budget} bytes"
    ran = [r for r in summary.records if r.measured]
    if not ran:
        return "no trial was measured"
    outcomes = ", ".join(f"{n} {o}" for o, n in sorted(Counter(r.outcome for r in ran).items()))
    return f"none of the {len(ran)} trials run gave a throughput ({outcomes}); see each trial's reason"
