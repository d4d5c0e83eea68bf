"""The study's running trials, any worker's: their heartbeats, which are alive, and the dead ones reaped.

A worker that dies mid-trial (SIGKILL, a lost machine) leaves its trial RUNNING in Optuna. Each trial
records its owner and a heartbeat (`TuningStudy.ask`, `InFlight.beat`); `tuner._liveness.dead_reason`
tells a live owner from a dead one, at once on the same host and after the grace period elsewhere.
A dead owner's trial is failed and its candidate queued again (`InFlight.reap_dead`); live ones count
towards ``n_trials`` while they run (`InFlight.running_alive`, read by `tuner._workers`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from lightning_recompute.policy import RecomputePolicy
from tuner._liveness import Owner, dead_reason
from tuner._search.attrs import TrialAttr
from tuner._search.space import SearchSpace

if TYPE_CHECKING:
    from tuner._search.study import Proposal, RecordOutcome

__all__ = ["AbandonedTrial", "InFlight"]

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
