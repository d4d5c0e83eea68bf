"""The Optuna study: its name, its constraint, ask/tell, and the records read back from it."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import re
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import optuna
from optuna.trial import FrozenTrial, TrialState

from lightning_recompute.errors import RecomputeError
from lightning_recompute.policy import RecomputePolicy
from lightning_recompute.units import format_bytes
from tuner._liveness import Owner, dead_reason
from tuner._search.attrs import StudyAttr, TrialAttr
from tuner._search.space import SearchSpace, Seed, Source, pick_of
from tuner._stores import open_storage

if TYPE_CHECKING:
    from lightning_recompute.planner.solver import Prediction
    from tuner._trials import TrialResult
    from tuner.recipe import Recipe

_log = logging.getLogger(__name__)

FAR_OVER_BUDGET = 1.25
"""Skip a candidate predicted above this multiple of the budget; below it the prediction's error could hide a fit."""

CONSTRAINT = "peak_minus_budget"
"""The Optuna constraint of every told trial (``Trial.set_constraint``): peak minus the budget limit."""

_FINISHED = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)


def study_name(recipe: Recipe, device: str) -> str:
    """``study.name``, or name.hardware.fingerprint: recipes that measure differently never share trials."""
    if recipe.study.name:
        return recipe.study.name
    hardware = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "unknown-device"
    return f"{recipe.name}.{hardware}.{recipe.fingerprint()[:8]}"


@dataclass
class Proposal:
    """A trial Optuna handed out: what it stands for and what the session decides about it."""

    trial: optuna.Trial
    policy: RecomputePolicy
    micro_batch: int | None
    label: str | None  # the seed's name (``baseline:full``, ``planner:budget``); None: sampled
    duplicate_of: FrozenTrial | None = None  # a trial of the same candidate measured, failed, or claimed
    contended_by: FrozenTrial | None = None  # another worker's unclaimed trial of it: this one stands down
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
"""A `tuner._trials.Outcome`, or ``duplicate``, ``interrupted`` (by the user), ``abandoned`` (its owner died)."""

RAN: tuple[RecordOutcome, ...] = ("ok", "over_budget", "oom", "timeout", "error", "nonfinite")  # n_trials counts
MEASURED: tuple[RecordOutcome, ...] = ("ok", "over_budget")  # with memory and speed figures
NOT_EVIDENCE: tuple[RecordOutcome, ...] = ("duplicate", "interrupted", "abandoned")  # never measured the candidate


@dataclass(frozen=True)
class TrialRecord:
    """One finished trial of the study, as its user attributes describe it (any worker's)."""

    number: int
    state: str  # Optuna's: COMPLETE, FAIL, PRUNED
    outcome: RecordOutcome
    policy: RecomputePolicy | None
    fingerprint: str
    short: str
    micro_batch: int | None
    label: str | None  # where the trial came from (`Source.of` reads it); None: sampled
    throughput: float | None = None
    throughput_unit: str = ""
    peak_bytes: int | None = None
    step_time_s: float | None = None
    noise_rel: float | None = None  # MAD of its step times over their median (None: too few, or an older study)
    wall_s: float | None = None  # its process's start to its end (None: it did not run)
    predicted_peak_bytes: int | None = None
    predicted_step_time_s: float | None = None
    reason: str | None = None
    run_id: str | None = None
    duplicate_of: int | None = None
    feasible: bool = False  # measured and within the budget limit

    @property
    def source(self) -> Source:
        return Source.of(self.label)

    @property
    def baseline(self) -> str | None:
        """The baseline's name (``full``) when the trial is one, else ``None``."""
        return pick_of(self.label) if self.source is Source.BASELINE else None

    @classmethod
    def from_trial(cls, t: FrozenTrial) -> TrialRecord:
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
            throughput_unit=str(a.get(TrialAttr.THROUGHPUT_UNIT) or ""),
            feasible=outcome == "ok" and peak_over is not None and float(peak_over) <= 0,
            **{name: a.get(_ATTR_OF.get(name, name)) for name in _AS_STORED},
        )

    @property
    def ran(self) -> bool:
        return self.outcome in RAN

    @property
    def measured(self) -> bool:
        return self.outcome in MEASURED

    def to_dict(self) -> dict[str, Any]:
        """A row of ``trials.json`` and ``trials.csv``; the label is ``seed``, the column of the first studies."""
        row: dict[str, Any] = {}
        for name, value in vars(self).items():
            row[_ROW_KEYS.get(name, name)] = value.to_dict() if isinstance(value, RecomputePolicy) else value
            if name == "label":
                row["source"] = self.source.value
        return row


_DERIVED = {"number", "state", "outcome", "policy", "fingerprint", "short", "throughput_unit", "feasible"}
_AS_STORED = [f.name for f in dataclasses.fields(TrialRecord) if f.name not in _DERIVED]
"""`TrialRecord` fields read from the trial's user attribute as they are: of their own name unless `_ATTR_OF`."""
_ATTR_OF = {"label": TrialAttr.SEED, "noise_rel": TrialAttr.NOISE_REL, "run_id": TrialAttr.RUN_ID}
_ROW_KEYS = {"fingerprint": "policy_fingerprint", "short": "policy_short", "label": "seed"}


def best_of(records: Sequence[TrialRecord]) -> TrialRecord | None:
    """The feasible record of highest throughput (the earlier trial on a tie); ``None`` when none is feasible."""
    feasible = [r for r in records if r.feasible and r.throughput is not None]
    return max(feasible, key=lambda r: (r.throughput or 0.0, -r.number)) if feasible else None


@dataclass(eq=False)
class TuningStudy:
    """An Optuna study driven by ask/tell; build one with `open`. Measured is COMPLETE (over budget too, infeasible
    by the constraint, so TPE learns where the memory wall is), skipped PRUNED, the rest FAIL."""

    study: optuna.Study
    space: SearchSpace
    budget_bytes: int
    created: bool  # this process created the study, and so seeds it
    storage: optuna.storages.BaseStorage  # for `tuner._search.lease`

    @classmethod
    def open(
        cls,
        *,
        name: str,
        storage: str,
        space: SearchSpace,
        budget_bytes: int,
        seed: int = 0,
        recipe: str | None = None,
        recipe_fingerprint: str | None = None,
        device: str | None = None,
    ) -> TuningStudy:
        """Create the study, or load it; only one process can create a study of a name: it seeds the study."""
        store = open_storage(storage)
        # Constraints are set on each trial (`_constrain`): Optuna 5 deprecates TPESampler's constraints_func.
        sampler = optuna.samplers.TPESampler(seed=seed)
        signature = space.signature()
        try:
            study = optuna.create_study(storage=store, study_name=name, direction="maximize", sampler=sampler)
        except optuna.exceptions.DuplicatedStudyError:
            # With the recipe's seed, workers on the same history would propose the same candidates in lockstep.
            own = hashlib.sha256(f"{seed}:{socket.gethostname()}:{os.getpid()}".encode()).hexdigest()[:8]
            study = optuna.load_study(
                study_name=name, storage=store, sampler=optuna.samplers.TPESampler(seed=int(own, 16))
            )
            stored = study.user_attrs.get(StudyAttr.SEARCH_SPACE)
            stored_budget = study.user_attrs.get(StudyAttr.BUDGET_BYTES)
            if stored is not None and stored != signature:
                raise RecomputeError(
                    f"study.name: study {name!r} was created for another search space ({stored}); this recipe "
                    f"searches {signature} (valid: another study.name, or the recipe that created it)"
                ) from None
            if stored_budget is not None and int(stored_budget) != int(budget_bytes):
                raise RecomputeError(
                    f"study.name: study {name!r} was tuned for a budget limit of {stored_budget} bytes, this "
                    f"recipe's is {budget_bytes} (valid: another study.name for another budget)"
                ) from None
            return cls(study, space, int(budget_bytes), created=False, storage=store)
        # The owner first: a worker waiting for this setup takes it over once this owner is dead.
        _own_setup(study)
        attrs = {
            StudyAttr.SEARCH_SPACE: signature,
            StudyAttr.BUDGET_BYTES: int(budget_bytes),
            StudyAttr.RECIPE: recipe,
            StudyAttr.RECIPE_FINGERPRINT: recipe_fingerprint,
            StudyAttr.DEVICE: device,
        }
        for key, value in attrs.items():
            if value is not None:
                study.set_user_attr(key, value)
        return cls(study, space, int(budget_bytes), created=True, storage=store)

    def seed(self, seeds: Sequence[Seed]) -> list[str]:
        """Enqueue those of ``seeds`` the study does not hold yet and mark it seeded; the names enqueued."""
        present = {
            t.user_attrs.get(TrialAttr.SEED_KEY) or t.user_attrs.get(TrialAttr.CANDIDATE_KEY)
            for t in self.study.get_trials(deepcopy=False)
            if t.user_attrs.get(TrialAttr.OUTCOME) not in NOT_EVIDENCE
        }
        enqueued = []
        for s in seeds:
            params = self.space.nearest(s.modes, s.micro_batch, s.compile)
            if params is None:
                _log.info("seed %s is outside the search space (modes %s)", s.name, sorted(set(s.modes.values())))
                continue
            key = _candidate_key(*self.space.decode(params))
            if key not in present:  # e.g. a planner candidate equal to a baseline: measure it once
                present.add(key)
                self.study.enqueue_trial(params, user_attrs={TrialAttr.SEED: s.name, TrialAttr.SEED_KEY: key})
                enqueued.append(s.name)
        self.study.set_user_attr(StudyAttr.SEEDED, True)
        return enqueued

    def ask(self, *, session_run_id: str | None = None) -> Proposal:
        """The next candidate: its key is written before the others are read, so of two workers asking it at once
        the later sees the earlier (trial numbers do not follow the order of asking)."""
        trial = self.study.ask(fixed_distributions=self.space.distributions())
        policy, mb = self.space.decode(trial.params)
        proposal = Proposal(trial=trial, policy=policy, micro_batch=mb, label=trial.user_attrs.get(TrialAttr.SEED))
        attrs = {
            TrialAttr.CANDIDATE_KEY: proposal.key,
            TrialAttr.POLICY: policy.to_dict(),
            TrialAttr.FINGERPRINT: policy.fingerprint(),
            TrialAttr.SHORT: policy.short(self.space.layer_names),
            TrialAttr.MICRO_BATCH: mb,
            TrialAttr.WORKER: f"{socket.gethostname()}:{os.getpid()}",
            TrialAttr.OWNER: Owner.me().to_dict(),
            TrialAttr.HEARTBEAT: time.time(),
            TrialAttr.SESSION_RUN: session_run_id,
        }
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        proposal.duplicate_of, proposal.contended_by = self._find_duplicate(proposal.key, trial.number)
        return proposal

    def claim(self, proposal: Proposal) -> None:
        """Once nothing can make it stand down: others asking its candidate now are its duplicates."""
        proposal.trial.set_user_attr(TrialAttr.CLAIMED, True)

    def _find_duplicate(self, key: str, number: int) -> tuple[FrozenTrial | None, FrozenTrial | None]:
        """``(duplicate_of, contended_by)`` for a proposal of ``key`` numbered ``number``."""
        finished: FrozenTrial | None = None
        contender: FrozenTrial | None = None
        for t in self.study.get_trials(deepcopy=False):
            a = t.user_attrs
            if t.number == number or a.get(TrialAttr.CANDIDATE_KEY) != key or a.get(TrialAttr.OUTCOME) in NOT_EVIDENCE:
                continue  # another candidate, or one never measured: not evidence about this candidate
            if t.state == TrialState.RUNNING:
                if a.get(TrialAttr.CLAIMED):
                    return t, None
                contender = contender or t
            # Prefer a measured trial to a skipped or failed one as the figures to reuse.
            elif t.state in _FINISHED and (
                finished is None or (t.state == TrialState.COMPLETE and finished.state != TrialState.COMPLETE)
            ):
                finished = t
        return finished, (None if finished is not None else contender)

    def tell_result(
        self, proposal: Proposal, result: TrialResult, *, run_id: str | None = None, reason: str | None = None
    ) -> FrozenTrial:
        """COMPLETE with its throughput when measured, FAIL otherwise."""
        t = proposal.trial
        self._set_common(
            proposal,
            outcome=result.outcome,
            run_id=run_id,
            reason=reason or result.error,
            **{
                TrialAttr.THROUGHPUT: result.throughput,
                TrialAttr.THROUGHPUT_UNIT: result.throughput_unit,
                TrialAttr.PEAK_BYTES: result.peak_bytes,
                TrialAttr.STEP_TIME_S: result.step_time_s,
                TrialAttr.WALL_S: result.wall_s,
                TrialAttr.NOISE_REL: None if result.noise is None else result.noise.mad_rel,
            },
        )
        if result.measured and result.throughput is not None:
            self._constrain(t, None if result.peak_bytes is None else result.peak_bytes - self.budget_bytes)
            return self.study.tell(t, float(result.throughput))
        return self.study.tell(t, state=TrialState.FAIL)

    def tell_skipped(self, proposal: Proposal, reason: str, *, run_id: str | None = None) -> FrozenTrial:
        """PRUNED: the planner predicts it far over budget."""
        self._set_common(proposal, outcome="skipped", run_id=run_id, reason=reason)
        pred = proposal.prediction
        peak = None if pred is None else pred.peak_bytes
        self._constrain(proposal.trial, None if peak is None else peak - self.budget_bytes)
        return self.study.tell(proposal.trial, state=TrialState.PRUNED)

    def tell_duplicate(self, proposal: Proposal, *, run_id: str | None = None) -> FrozenTrial:
        """Its original's state and value, or FAIL while the original still runs."""
        original, t = proposal.duplicate_of, proposal.trial
        assert original is not None, "told a duplicate that is none"
        reason = f"same policy and micro-batch as trial {original.number}"
        self._set_common(
            proposal, outcome="duplicate", run_id=run_id, reason=reason, **{TrialAttr.DUPLICATE_OF: original.number}
        )
        if original.state == TrialState.RUNNING:
            return self.study.tell(t, state=TrialState.FAIL)
        # Only the constraint is copied: the table and the plot show each measurement once.
        if original.state in (TrialState.COMPLETE, TrialState.PRUNED):
            self._constrain(t, original.user_attrs.get(TrialAttr.PEAK_OVER))
        if original.state == TrialState.COMPLETE and original.value is not None:
            return self.study.tell(t, float(original.value))
        return self.study.tell(t, state=original.state)

    def tell_interrupted(self, proposal: Proposal, reason: str) -> FrozenTrial:
        """FAIL; a seed goes back in the queue for the next session."""
        t = proposal.trial
        self._set_common(proposal, outcome="interrupted", run_id=None, reason=reason)
        frozen = self.study.tell(t, state=TrialState.FAIL, skip_if_finished=True)
        if proposal.label is not None:
            attrs = {TrialAttr.SEED: proposal.label, TrialAttr.SEED_KEY: proposal.key}
            self.study.enqueue_trial(dict(t.params), user_attrs=attrs)
        return frozen

    @staticmethod
    def _constrain(trial: optuna.Trial, peak_over: float | None) -> None:
        # Unknown memory counts as infeasible; the user attribute is what the trials table reads.
        value = math.inf if peak_over is None else float(peak_over)
        trial.set_user_attr(TrialAttr.PEAK_OVER, None if peak_over is None else value)
        trial.set_constraint(CONSTRAINT, value)

    @staticmethod
    def _set_common(
        proposal: Proposal, *, outcome: RecordOutcome, run_id: str | None, reason: str | None, **more: Any
    ) -> None:
        pred = proposal.prediction
        attrs = {
            TrialAttr.OUTCOME: outcome,
            TrialAttr.RUN_ID: run_id,
            TrialAttr.REASON: reason,
            TrialAttr.PREDICTED_PEAK_BYTES: None if pred is None else pred.peak_bytes,
            TrialAttr.PREDICTED_STEP_TIME_S: None if pred is None else pred.step_time_s,
            **more,
        }
        for key, value in attrs.items():
            proposal.trial.set_user_attr(key, value)

    def records(self) -> list[TrialRecord]:
        return [TrialRecord.from_trial(t) for t in self.study.get_trials(deepcopy=False, states=_FINISHED)]

    def best(self) -> TrialRecord | None:
        return best_of(self.records())

    def ran_count(self) -> int:
        """What ``n_trials`` counts, all workers together."""
        return sum(1 for r in self.records() if r.ran)

    def waiting(self) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))

    def running(self) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))

    def running_alive(self, grace_s: float) -> int:
        """RUNNING trials whose owner may be alive (this worker's own included)."""
        return sum(1 for t in self.running() if _dead(t, grace_s) is None)

    def reap_dead(self, grace_s: float) -> list[tuple[FrozenTrial, str]]:
        """Fail every RUNNING trial whose owner is dead and enqueue its candidate again; each with why. Of several
        processes reaping at once, only the one whose state change wins reports and re-enqueues it."""
        storage = self.study._storage  # Optuna's public Study has no way to fail another process's trial
        out = []
        for t in self.running():
            why = _dead(t, grace_s)
            if why is None:
                continue
            try:
                storage.set_trial_user_attr(t._trial_id, TrialAttr.OUTCOME, "abandoned")
                storage.set_trial_user_attr(t._trial_id, TrialAttr.REASON, why)
                if not storage.set_trial_state_values(t._trial_id, TrialState.FAIL):
                    continue
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # another process reaped it (or its owner finished it) first
            a = t.user_attrs
            attrs = {
                TrialAttr.RETRY_OF: t.number,
                TrialAttr.SEED_KEY: a.get(TrialAttr.CANDIDATE_KEY),
                TrialAttr.SEED: a.get(TrialAttr.SEED),
            }
            self.study.enqueue_trial(dict(t.params), user_attrs={k: v for k, v in attrs.items() if v is not None})
            out.append((t, why))
            _log.info("trial %d: %s; failed and its candidate enqueued again", t.number, why)
        return out

    def wait_or_take_setup(self, timeout_s: float, grace_s: float, poll_s: float = 0.5) -> str | None:
        """``None`` once the worker setting the study up has seeded it; else why this process now owns the setup:
        that worker died, gave up, or took longer than ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            attrs = self.study.user_attrs
            if attrs.get(StudyAttr.SEEDED):
                return None
            why = _owner_dead(attrs, StudyAttr.SETUP_OWNER, StudyAttr.SETUP_HEARTBEAT, grace_s)
            if why is None and attrs.get(StudyAttr.ABANDONED):
                why = "the worker setting it up gave up"
            elif why is None and time.monotonic() >= deadline:
                why = f"the worker setting it up took longer than {timeout_s:g} s"
            if why is not None:
                _own_setup(self.study)
                return why
            time.sleep(poll_s)

    def abandon_setup(self) -> None:
        """Let a waiting worker take the setup over at once instead of waiting for this one to die."""
        if not self.study.user_attrs.get(StudyAttr.SEEDED):
            self.study.set_user_attr(StudyAttr.ABANDONED, True)


def far_over_budget(prediction: Prediction | None, budget_bytes: int) -> str | None:
    """Why a candidate should not be run, or ``None`` when it should."""
    peak = None if prediction is None else prediction.peak_bytes
    if peak is None or peak <= FAR_OVER_BUDGET * budget_bytes:
        return None
    return (
        f"planner predicts a peak of {format_bytes(peak)} ({peak} bytes), more than {FAR_OVER_BUDGET:g}x the budget "
        f"limit of {format_bytes(budget_bytes)} ({budget_bytes} bytes)"
    )


def _owner_dead(
    attrs: Mapping[str, Any], owner_key: str, beat_key: str, grace_s: float, since: float | None = None
) -> str | None:
    """Why the owner recorded in ``attrs`` (a trial's or the study's) is dead, or ``None``."""
    beat = attrs.get(beat_key)
    owner = Owner.from_dict(attrs.get(owner_key))
    return dead_reason(owner, None if beat is None else float(beat), grace=grace_s, since=since)


def _dead(trial: FrozenTrial, grace_s: float) -> str | None:
    since = trial.datetime_start.timestamp() if trial.datetime_start is not None else None
    return _owner_dead(trial.user_attrs, TrialAttr.OWNER, TrialAttr.HEARTBEAT, grace_s, since)


def _own_setup(study: optuna.Study) -> None:
    study.set_user_attr(StudyAttr.SETUP_OWNER, Owner.me().to_dict())
    study.set_user_attr(StudyAttr.SETUP_HEARTBEAT, time.time())
    if study.user_attrs.get(StudyAttr.ABANDONED):  # taken over: a worker arriving now waits for this owner
        study.set_user_attr(StudyAttr.ABANDONED, False)
