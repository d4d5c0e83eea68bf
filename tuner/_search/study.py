"""The Optuna study: its name, its constraint, ask/tell, and the records read back from it."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import optuna
from optuna.trial import FrozenTrial, TrialState

from lightning_recompute.errors import RecomputeError
from lightning_recompute.policy import RecomputePolicy
from lightning_recompute.units import format_bytes
from tuner._liveness import Owner, dead_reason
from tuner._search.attrs import StudyAttr, TrialAttr
from tuner._search.seeds import Seed, Source, pick_of
from tuner._search.setup_state import StudySetup
from tuner._search.space import SearchSpace
from tuner._stores import open_storage

if TYPE_CHECKING:
    from lightning_recompute.planner.solver import Prediction
    from tuner._trials import TrialResult
    from tuner.recipe import Recipe

_log = logging.getLogger(__name__)


FAR_OVER_BUDGET = 1.25
"""A candidate the planner predicts above this multiple of the budget is recorded as skipped, not run.
Below it, the prediction's error (the planner is a model) could still hide a policy that fits."""


# ---------------------------------------------------------------------------------------------- naming


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


CONSTRAINT = "peak_minus_budget"
"""The Optuna constraint of every told trial (``Trial.set_constraint``): peak minus the budget limit."""


def peak_constraint(trial: FrozenTrial) -> tuple[float]:
    """The trial's memory constraint: measured (or, for a skipped trial, predicted) peak minus the budget.

    Positive means infeasible, so Optuna never reports an over-budget trial as the best one. A
    trial without a figure is infeasible too: a policy whose memory is unknown cannot be promised
    to fit.
    """
    value = trial.constraints.get(CONSTRAINT, trial.user_attrs.get(TrialAttr.PEAK_OVER))
    return (float(value) if value is not None else math.inf,)


# ---------------------------------------------------------------------------------------------- the study


@dataclass
class Proposal:
    """A trial Optuna handed out: what it stands for and what the session decides about it."""

    trial: optuna.Trial
    policy: RecomputePolicy
    micro_batch: int | None
    label: str | None
    """Where the trial came from when it was enqueued (``baseline:full``, ``planner:budget``), else ``None``
    (sampled; `Source`)."""
    duplicate_of: FrozenTrial | None = None
    """A trial of the same policy and micro-batch already measured, failed, or claimed for measuring."""
    contended_by: FrozenTrial | None = None
    """Another worker's trial of the same candidate, asked at the same moment and not yet claimed: neither
    worker can know whether the other measures it, so this one stands down (`TuningStudy.ask`)."""
    prediction: Prediction | None = None

    @property
    def number(self) -> int:
        return self.trial.number

    @property
    def key(self) -> str:
        return _candidate_key(self.policy, self.micro_batch)


def _candidate_key(policy: RecomputePolicy, micro_batch: int | None) -> str:
    return f"{policy.fingerprint()}@{micro_batch if micro_batch is not None else '-'}"


RecordOutcome = Literal[
    "ok", "over_budget", "oom", "timeout", "error", "nonfinite", "skipped", "duplicate", "interrupted", "abandoned"
]
"""What became of a trial of the study: a `tuner._trials.Outcome` (what a trial that ran, or was skipped on the
planner's prediction, ended as), or ``duplicate`` (a re-proposal, never run again), ``interrupted`` (stopped by
the user) or ``abandoned`` (its owner died mid-trial)."""

RAN: tuple[RecordOutcome, ...] = ("ok", "over_budget", "oom", "timeout", "error", "nonfinite")
"""Outcomes of a trial that ran its policy to an end (`TrialRecord.ran`; what ``n_trials`` counts)."""

MEASURED: tuple[RecordOutcome, ...] = ("ok", "over_budget")
"""Outcomes of a trial that produced memory and speed figures (`TrialRecord.measured`)."""

NOT_EVIDENCE: tuple[RecordOutcome, ...] = ("duplicate", "interrupted", "abandoned")
"""Outcomes of trials that never measured their candidate: neither a duplicate's original nor a seed's."""


@dataclass(frozen=True)
class TrialRecord:
    """One finished trial of the study, as its user attributes describe it (any worker's)."""

    number: int
    state: str
    """Optuna's state name: COMPLETE, FAIL, PRUNED (RUNNING/WAITING are not records)."""
    outcome: RecordOutcome
    """ok / over_budget / oom / timeout / error / nonfinite / skipped, or duplicate / interrupted / abandoned (never
    run)."""
    policy: RecomputePolicy | None
    fingerprint: str
    short: str
    micro_batch: int | None
    label: str | None
    """Where the trial came from (`Source.of` reads it): ``baseline:full``, ``planner:budget`` ...; ``None``:
    sampled."""
    throughput: float | None = None
    throughput_unit: str = ""
    peak_bytes: int | None = None
    step_time_s: float | None = None
    noise_rel: float | None = None
    """The trial's noise: MAD of its step times over their median (``None``: too few steps, or an older study)."""
    wall_s: float | None = None
    """Seconds the trial took, its process's start to its end (``None``: it did not run)."""
    predicted_peak_bytes: int | None = None
    predicted_step_time_s: float | None = None
    reason: str | None = None
    run_id: str | None = None
    duplicate_of: int | None = None
    feasible: bool = False
    """Measured and within the budget limit."""

    @property
    def source(self) -> Source:
        return Source.of(self.label)

    @property
    def baseline(self) -> str | None:
        """The baseline's name (``full``) when the trial is one, else ``None``."""
        return pick_of(self.label) if self.source is Source.BASELINE else None

    @classmethod
    def from_trial(cls, t: FrozenTrial) -> TrialRecord:
        """The record of a finished Optuna trial, read from its user attributes."""
        a = t.user_attrs
        peak_over = a.get(TrialAttr.PEAK_OVER)
        # Written by `TuningStudy` (or `InFlight.reap_dead`), so one of RecordOutcome's.
        outcome = cast(RecordOutcome, str(a.get(TrialAttr.OUTCOME, "error")))
        return cls(
            number=t.number,
            state=t.state.name,
            outcome=outcome,
            policy=RecomputePolicy.from_dict(a[TrialAttr.POLICY]) if a.get(TrialAttr.POLICY) else None,
            fingerprint=str(a.get(TrialAttr.FINGERPRINT, "")),
            short=str(a.get(TrialAttr.SHORT, "")),
            micro_batch=a.get(TrialAttr.MICRO_BATCH),
            label=a.get(TrialAttr.SEED),
            throughput=a.get(TrialAttr.THROUGHPUT),
            throughput_unit=str(a.get(TrialAttr.THROUGHPUT_UNIT) or ""),
            peak_bytes=a.get(TrialAttr.PEAK_BYTES),
            step_time_s=a.get(TrialAttr.STEP_TIME_S),
            noise_rel=a.get(TrialAttr.NOISE_REL),
            wall_s=a.get(TrialAttr.WALL_S),
            predicted_peak_bytes=a.get(TrialAttr.PREDICTED_PEAK_BYTES),
            predicted_step_time_s=a.get(TrialAttr.PREDICTED_STEP_TIME_S),
            reason=a.get(TrialAttr.REASON),
            run_id=a.get(TrialAttr.RUN_ID),
            duplicate_of=a.get(TrialAttr.DUPLICATE_OF),
            feasible=outcome == "ok" and peak_over is not None and float(peak_over) <= 0,
        )

    @property
    def ran(self) -> bool:
        """Whether this trial ran the policy to an outcome: measured, or oom / timeout / error / nonfinite
        (duplicates, skips, interruptions and abandoned trials did not). What ``n_trials`` counts."""
        return self.outcome in RAN

    @property
    def measured(self) -> bool:
        """Whether this trial produced memory and speed figures (``ok`` or ``over_budget``), as
        `tuner._trials.TrialResult.measured` means it; a trial can have `ran` without being measured."""
        return self.outcome in MEASURED

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
            "seed": self.label,  # the trials table's column since the first studies (trials.csv, JSON)
            "source": self.source.value,
            "throughput": self.throughput,
            "throughput_unit": self.throughput_unit,
            "peak_bytes": self.peak_bytes,
            "step_time_s": self.step_time_s,
            "noise_rel": self.noise_rel,
            "wall_s": self.wall_s,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_step_time_s": self.predicted_step_time_s,
            "reason": self.reason,
            "run_id": self.run_id,
            "duplicate_of": self.duplicate_of,
            "feasible": self.feasible,
        }


def best_of(records: Sequence[TrialRecord]) -> TrialRecord | None:
    """The feasible record of highest throughput (the earlier trial on a tie); ``None`` when none is feasible."""
    feasible = [r for r in records if r.feasible and r.throughput is not None]
    return max(feasible, key=lambda r: (r.throughput or 0.0, -r.number)) if feasible else None


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

    def __init__(
        self,
        study: optuna.Study,
        space: SearchSpace,
        *,
        budget_bytes: int,
        created: bool,
        storage: optuna.storages.BaseStorage | None = None,
    ) -> None:
        self.study = study
        self.storage = storage
        """The storage the study lives in (for `tuner._search.lease`); ``None`` when not known."""
        self.space = space
        self.budget_bytes = int(budget_bytes)
        self.created = created
        """Whether this process created the study (and so seeds it)."""
        self.setup = StudySetup(study)
        """Who sets the study up, whether it is seeded, the profile and planner note it stored."""
        self.in_flight = InFlight(study, space)
        """The study's running trials (any worker's): heartbeats, which are alive, the dead ones reaped."""
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
        recipe: str | None = None,
        recipe_fingerprint: str | None = None,
        device: str | None = None,
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
            # Recorded first: a worker waiting for this setup takes it over once this owner is dead.
            StudySetup(study).own()
            study.set_user_attr(StudyAttr.SEARCH_SPACE, space.signature())
            study.set_user_attr(StudyAttr.BUDGET_BYTES, int(budget_bytes))
            for key, value in (
                (StudyAttr.RECIPE, recipe),
                (StudyAttr.RECIPE_FINGERPRINT, recipe_fingerprint),
                (StudyAttr.DEVICE, device),
            ):
                if value is not None:
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
            stored = study.user_attrs.get(StudyAttr.SEARCH_SPACE)
            if stored is not None and stored != space.signature():
                raise RecomputeError(
                    f"study.name: study {name!r} was created for another search space ({stored}); this recipe "
                    f"searches {space.signature()} (valid: another study.name, or the recipe that created it)"
                ) from None
            stored_budget = study.user_attrs.get(StudyAttr.BUDGET_BYTES)
            if stored_budget is not None and int(stored_budget) != int(budget_bytes):
                raise RecomputeError(
                    f"study.name: study {name!r} was tuned for a budget limit of {stored_budget} bytes, this "
                    f"recipe's is {budget_bytes} (valid: another study.name for another budget)"
                ) from None
        return cls(study, space, budget_bytes=budget_bytes, created=created, storage=store)

    def seed(self, seeds: Sequence[Seed]) -> list[str]:
        """Enqueue those of ``seeds`` the study does not hold yet, mark it seeded; the names enqueued.

        Call it once per study (the creator, or a session taking over an abandoned setup): a
        resumed session must not seed again. Seeds already present (a planner candidate equal to
        a baseline; a seed another worker enqueued) are not enqueued twice.
        """
        present = {
            t.user_attrs.get(TrialAttr.SEED_KEY) or t.user_attrs.get(TrialAttr.CANDIDATE_KEY)
            for t in self.study.get_trials(deepcopy=False)
            if t.user_attrs.get(TrialAttr.OUTCOME) not in NOT_EVIDENCE
        }
        enqueued = []
        for s in seeds:
            params = self.space.nearest(s.modes, s.micro_batch, s.compile)
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
            self.study.enqueue_trial(params, user_attrs={TrialAttr.SEED: s.name, TrialAttr.SEED_KEY: key})
            enqueued.append(s.name)
        self.setup.mark_seeded()
        return enqueued

    # -------------------------------------------------------------- ask

    def ask(self, *, session_run_id: str | None = None) -> Proposal:
        """The next candidate (an enqueued seed first), with `Proposal.duplicate_of` filled in.

        The candidate's key (policy fingerprint and micro-batch) is written to the trial before
        the other trials are read, so of two workers proposing the same candidate at once the
        later reader always sees the earlier trial. A trial of the same candidate still running
        is a duplicate's original once its worker has `claim`-ed it; before that it may be
        standing down itself, so this proposal is `Proposal.contended_by` it and stands down too
        (a seed goes back in the queue). Trial numbers cannot settle who measures: they do not
        follow the order of asking (an enqueued seed keeps the number it got when enqueued).
        The trial records its owner (this process) and ``session_run_id``, so that if this process
        dies another one can fail the trial, record it in MLflow and retry its candidate
        (`InFlight.reap_dead`).
        """
        trial = self.study.ask(fixed_distributions=self._distributions)
        policy, mb = self.space.decode(trial.params)
        seed_name = trial.user_attrs.get(TrialAttr.SEED)
        proposal = Proposal(trial=trial, policy=policy, micro_batch=mb, label=seed_name)
        key = proposal.key
        trial.set_user_attr(TrialAttr.CANDIDATE_KEY, key)
        trial.set_user_attr(TrialAttr.POLICY, policy.to_dict())
        trial.set_user_attr(TrialAttr.FINGERPRINT, policy.fingerprint())
        trial.set_user_attr(TrialAttr.SHORT, policy.short(self.space.layer_names))
        trial.set_user_attr(TrialAttr.MICRO_BATCH, mb)
        trial.set_user_attr(TrialAttr.WORKER, f"{socket.gethostname()}:{os.getpid()}")
        trial.set_user_attr(TrialAttr.OWNER, Owner.me().to_dict())
        trial.set_user_attr(TrialAttr.HEARTBEAT, time.time())
        trial.set_user_attr(TrialAttr.SESSION_RUN, session_run_id)
        proposal.duplicate_of, proposal.contended_by = self._find_duplicate(key, trial.number)
        return proposal

    def claim(self, proposal: Proposal) -> None:
        """Mark the proposal as measured by this worker: others asking its candidate now are its duplicates.

        Called once the proposal has passed every check that could make it stand down (the session's
        ``n_trials`` slot and `Proposal.contended_by`), and before it runs.
        """
        proposal.trial.set_user_attr(TrialAttr.CLAIMED, True)

    def _find_duplicate(self, key: str, number: int) -> tuple[FrozenTrial | None, FrozenTrial | None]:
        """``(duplicate_of, contended_by)`` for a proposal of ``key`` numbered ``number``."""
        finished: FrozenTrial | None = None
        contender: FrozenTrial | None = None
        for t in self.study.get_trials(deepcopy=False):
            if t.number == number or t.user_attrs.get(TrialAttr.CANDIDATE_KEY) != key:
                continue
            outcome = t.user_attrs.get(TrialAttr.OUTCOME)
            if outcome in NOT_EVIDENCE:
                continue  # never measured: not evidence about this candidate
            if t.state == TrialState.RUNNING:
                if t.user_attrs.get(TrialAttr.CLAIMED):
                    return t, None
                contender = contender or t
                continue
            # Prefer a measured trial to a skipped or failed one as the figures to reuse.
            if t.state in (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED) and (
                finished is None or (t.state == TrialState.COMPLETE and finished.state != TrialState.COMPLETE)
            ):
                finished = t
        return finished, (None if finished is not None else contender)

    # -------------------------------------------------------------- tell

    def tell_result(
        self, proposal: Proposal, result: TrialResult, *, run_id: str | None = None, reason: str | None = None
    ) -> FrozenTrial:
        """Record a trial that ran: COMPLETE with its throughput when measured, FAIL otherwise."""
        t = proposal.trial
        self._set_common(proposal, outcome=result.outcome, run_id=run_id, reason=reason or result.error)
        for key, value in (
            (TrialAttr.THROUGHPUT, result.throughput),
            (TrialAttr.THROUGHPUT_UNIT, result.throughput_unit),
            (TrialAttr.PEAK_BYTES, result.peak_bytes),
            (TrialAttr.STEP_TIME_S, result.step_time_s),
            (TrialAttr.WALL_S, result.wall_s),
            (TrialAttr.NOISE_REL, None if result.noise is None else result.noise.mad_rel),
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
        t.set_user_attr(TrialAttr.DUPLICATE_OF, original.number)
        if original.state == TrialState.RUNNING:
            return self.study.tell(t, state=TrialState.FAIL)
        # Only the constraint is copied: the figures stay with the trial that measured them, so
        # the trials table and the Pareto plot show each measurement once.
        if original.state in (TrialState.COMPLETE, TrialState.PRUNED):
            self._constrain(t, original.user_attrs.get(TrialAttr.PEAK_OVER))
        if original.state == TrialState.COMPLETE and original.value is not None:
            return self.study.tell(t, float(original.value))
        return self.study.tell(t, state=original.state)

    def tell_interrupted(self, proposal: Proposal, reason: str) -> FrozenTrial:
        """Record a trial stopped by the user (FAIL); a seed goes back in the queue for the next session."""
        t = proposal.trial
        self._set_common(proposal, outcome="interrupted", run_id=None, reason=reason)
        frozen = self.study.tell(t, state=TrialState.FAIL, skip_if_finished=True)
        if proposal.label is not None:
            self.study.enqueue_trial(
                dict(t.params), user_attrs={TrialAttr.SEED: proposal.label, TrialAttr.SEED_KEY: proposal.key}
            )
        return frozen

    @staticmethod
    def _constrain(trial: optuna.Trial, peak_over: float | None) -> None:
        # Unknown memory counts as infeasible (see `peak_constraint`); kept as a user attribute
        # too, where the trials table reads it.
        value = math.inf if peak_over is None else float(peak_over)
        trial.set_user_attr(TrialAttr.PEAK_OVER, None if peak_over is None else value)
        trial.set_constraint(CONSTRAINT, value)

    def _set_common(
        self, proposal: Proposal, *, outcome: RecordOutcome, run_id: str | None, reason: str | None
    ) -> None:
        t = proposal.trial
        t.set_user_attr(TrialAttr.OUTCOME, outcome)
        t.set_user_attr(TrialAttr.RUN_ID, run_id)
        t.set_user_attr(TrialAttr.REASON, reason)
        pred = proposal.prediction
        t.set_user_attr(TrialAttr.PREDICTED_PEAK_BYTES, None if pred is None else pred.peak_bytes)
        t.set_user_attr(TrialAttr.PREDICTED_STEP_TIME_S, None if pred is None else pred.step_time_s)

    # -------------------------------------------------------------- reading back

    def records(self) -> list[TrialRecord]:
        """Every finished trial of the study (all workers, all sessions), in trial order."""
        finished = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)
        return [TrialRecord.from_trial(t) for t in self.study.get_trials(deepcopy=False, states=finished)]

    def best(self) -> TrialRecord | None:
        """The measured, within-budget trial of highest throughput; ``None`` when there is none."""
        return best_of(self.records())

    def ran_count(self) -> int:
        """Trials that ran a policy (`TrialRecord.ran`: what ``n_trials`` counts), all workers together."""
        return sum(1 for r in self.records() if r.ran)

    def waiting(self) -> list[FrozenTrial]:
        """Enqueued trials not yet handed out."""
        return self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))


Predictor = Callable[[RecomputePolicy, int | None], "Prediction | None"]
"""``(policy, micro_batch) -> Prediction | None``: the planner's view of a candidate, if it has one."""


def far_over_budget(prediction: Prediction | None, budget_bytes: int, factor: float = FAR_OVER_BUDGET) -> str | None:
    """Why a candidate should not be run, or ``None`` when it should."""
    if prediction is None or prediction.peak_bytes is None:
        return None
    if prediction.peak_bytes > factor * budget_bytes:
        return (
            f"planner predicts a peak of {format_bytes(prediction.peak_bytes)} ({prediction.peak_bytes} bytes),"
            f" more than {factor:g}x the budget "
            f"limit of {format_bytes(budget_bytes)} ({budget_bytes} bytes)"
        )
    return None


# -------------------------------------------------------------------------------- in_flight
# The study's running trials, any worker's: their heartbeats, which are alive, and the dead ones reaped.

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AbandonedTrial:
    """A trial whose owner died, failed by `InFlight.reap_dead`: what its MLflow record needs."""

    number: int
    policy: RecomputePolicy
    micro_batch: int | None
    reason: str
    session_run_id: str | None
    """The dead owner's MLflow session run (``None``: it had none yet)."""


def _dead(trial: FrozenTrial, grace_s: float) -> str | None:
    """Why ``trial``'s owner is dead, or ``None`` while it may be alive (`tuner._liveness.dead_reason`)."""
    beat = trial.user_attrs.get(TrialAttr.HEARTBEAT)
    since = trial.datetime_start.timestamp() if trial.datetime_start is not None else None
    owner = Owner.from_dict(trial.user_attrs.get(TrialAttr.OWNER))
    return dead_reason(owner, float(beat) if beat is not None else None, grace=grace_s, since=since)


class InFlight:
    """The running trials of ``study`` (an Optuna study searching ``space``)."""

    def __init__(self, study: optuna.Study, space: SearchSpace) -> None:
        self.study = study
        self.space = space

    def running(self) -> list[FrozenTrial]:
        """Trials Optuna holds as running (this or another worker's)."""
        return self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))

    def running_alive(self, grace_s: float) -> int:
        """RUNNING trials whose owner may be alive (this worker's own included)."""
        return sum(1 for t in self.running() if _dead(t, grace_s) is None)

    def beat(self, proposal: Proposal) -> None:
        """The heartbeat of a trial this process runs."""
        proposal.trial.set_user_attr(TrialAttr.HEARTBEAT, time.time())

    def reap_dead(self, grace_s: float) -> list[AbandonedTrial]:
        """Fail every RUNNING trial whose owner is dead, enqueue its candidate again; those this call failed.

        A trial is dead when `tuner._liveness.dead_reason` says so for its recorded owner and
        heartbeat (a trial without an owner, from an older version, after ``grace_s`` from its
        start). Its record says ``abandoned`` and why; it is FAIL in Optuna, and its candidate is
        enqueued again (a seed keeps its name), so the next ask measures it. Of several processes
        reaping at once, only the one whose state change wins reports (and re-enqueues) the trial.
        """
        storage = self.study._storage  # Optuna's public Study has no way to fail another process's trial
        out: list[AbandonedTrial] = []
        for t in self.running():
            why = _dead(t, grace_s)
            if why is None:
                continue
            a = t.user_attrs
            try:
                abandoned: RecordOutcome = "abandoned"
                storage.set_trial_user_attr(t._trial_id, TrialAttr.OUTCOME, abandoned)
                storage.set_trial_user_attr(t._trial_id, TrialAttr.REASON, why)
                won = storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # another process reaped it (or its owner finished it) first
            if not won:
                continue
            attrs: dict[str, Any] = {TrialAttr.RETRY_OF: t.number}
            key = a.get(TrialAttr.CANDIDATE_KEY)
            if key is not None:
                attrs[TrialAttr.SEED_KEY] = key
            if a.get(TrialAttr.SEED) is not None:
                attrs[TrialAttr.SEED] = a[TrialAttr.SEED]
            self.study.enqueue_trial(dict(t.params), user_attrs=attrs)
            policy, mb = self.space.decode(t.params)
            out.append(
                AbandonedTrial(
                    number=t.number,
                    policy=policy,
                    micro_batch=mb,
                    reason=why,
                    session_run_id=a.get(TrialAttr.SESSION_RUN),
                )
            )
            _log.info("trial %d: %s; failed and its candidate enqueued again", t.number, why)
        return out
