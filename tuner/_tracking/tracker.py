"""`Tracker`: the one object the tuner records through (session log and good-policy registry)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from lightning_recompute.policy import RecomputePolicy
from tuner._stores import sqlite_setup_lock
from tuner._tracking.client import TrackingClient
from tuner._tracking.registry import Decision, GoodPolicy, PolicyRegistry
from tuner._tracking.sessions import SessionLog

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from lightning_recompute.race import RaceResult
    from tuner._trials import TrialResult
    from tuner.recipe import Recipe

__all__ = ["Tracker", "open_tracker"]


class Tracker:
    """MLflow bookkeeping of tuning sessions (`SessionLog`) and of the experiment's good policy (`PolicyRegistry`).

    Use it as a context manager (or `session`) so the session run always ends: FINISHED on a
    normal exit, KILLED on Ctrl-C, FAILED on an exception, and never stays RUNNING::

        with Tracker(recipe.tracking.uri, recipe.tracking.experiment) as tracker:
            tracker.start_session(recipe, study_name=study.study_name)
            tracker.log_trial(0, policy, names, None, result)
            rows = [r.to_dict() for r in study.records()]  # the trials table: `TrialRecord.to_dict` rows
            tracker.finish_session(status="FINISHED", best=..., trials_table=rows, baselines={}, budget_bytes=limit)

    A decision (promote, reject, rollback) made while a session is open nests in its run.

    The two halves share one `TrackingClient` (``store``); each method here hands over to
    ``sessions`` or ``registry``, and a decision is told the open session run explicitly.

    Args:
        tracking_uri: the MLflow tracking URI (``sqlite:///mlflow.db`` by default in recipes).
        experiment: the experiment name (one per recipe); created when missing, with artifacts
            under the sqlite database's folder (`artifact_location_for`).
        artifact_location: overrides where a newly created experiment keeps artifacts.
        create: create the experiment when missing (``False``: raise `ExperimentNotFound`, for readers).
    """

    def __init__(
        self,
        tracking_uri: str | None,
        experiment: str,
        *,
        artifact_location: str | None = None,
        create: bool = True,
    ) -> None:
        self.store = TrackingClient(tracking_uri, experiment, artifact_location=artifact_location, create=create)
        """The experiment's MLflow client, shared by `sessions` and `registry`."""
        self.sessions = SessionLog(self.store)
        """The session run and the trial and confirmation runs nested in it."""
        self.registry = PolicyRegistry(self.store)
        """The good policy and its decision runs."""

    # ------------------------------------------------------------------ the experiment

    @property
    def tracking_uri(self) -> str:
        """The MLflow tracking URI in use."""
        return self.store.tracking_uri

    @property
    def experiment(self) -> str:
        """The experiment's name."""
        return self.store.experiment

    @property
    def experiment_id(self) -> str:
        """The experiment's id."""
        return self.store.experiment_id

    @property
    def client(self) -> MlflowClient:
        """The `mlflow.MlflowClient` every record goes through."""
        return self.store.client

    @property
    def relocated_from(self) -> str | None:
        """The artifact folder the experiment was recorded under before its results folder moved."""
        return self.store.relocated_from

    # ------------------------------------------------------------------ sessions (`SessionLog`)

    @property
    def session_run_id(self) -> str | None:
        """The current session run (``None`` before `start_session`); see `SessionLog.session_run_id`."""
        return self.sessions.session_run_id

    def start_session(self, recipe: Recipe, *, study_name: str, resume: bool = True) -> str:
        """Open the session run for ``study_name``; its run id (`SessionLog.start_session`)."""
        return self.sessions.start_session(recipe, study_name=study_name, resume=resume)

    def log_trial(
        self,
        number: int,
        policy: RecomputePolicy,
        layer_names: Sequence[str] | None,
        micro_batch: int | None,
        result: TrialResult,
        prediction: Mapping[str, Any] | None = None,
        reason: str | None = None,
    ) -> str:
        """Record one trial as a finished run nested in the session; its run id (`SessionLog.log_trial`)."""
        return self.sessions.log_trial(number, policy, layer_names, micro_batch, result, prediction, reason)

    def beat(self) -> None:
        """The session run's heartbeat (`SessionLog.beat`)."""
        self.sessions.beat()

    def log_abandoned_trial(
        self,
        number: int,
        policy: RecomputePolicy,
        layer_names: Sequence[str] | None,
        micro_batch: int | None,
        *,
        reason: str,
        session_run_id: str | None,
    ) -> str:
        """Record a trial whose owner died mid-trial; its run id (`SessionLog.log_abandoned_trial`)."""
        return self.sessions.log_abandoned_trial(
            number, policy, layer_names, micro_batch, reason=reason, session_run_id=session_run_id
        )

    def end_dead_sessions(self, study_name: str, grace_s: float) -> list[str]:
        """End KILLED the RUNNING session runs of dead owners; their ids (`SessionLog.end_dead_sessions`)."""
        return self.sessions.end_dead_sessions(study_name, grace_s)

    def log_confirmation(
        self,
        policy: RecomputePolicy,
        layer_names: Sequence[str] | None,
        micro_batch: int | None,
        result: TrialResult,
        *,
        source_run_id: str | None = None,
        evidence: Mapping[str, Any] | None = None,
    ) -> str:
        """Record the evidence gate's confirmation run; its id (`SessionLog.log_confirmation`)."""
        return self.sessions.log_confirmation(
            policy, layer_names, micro_batch, result, source_run_id=source_run_id, evidence=evidence
        )

    def finish_session(
        self,
        *,
        status: str,
        best: Mapping[str, Any] | None,
        trials_table: Sequence[Mapping[str, Any]],
        baselines: Mapping[str, Mapping[str, Any]],
        budget_bytes: int | None,
    ) -> None:
        """Write the session's summary artifacts and end its run (`SessionLog.finish_session`)."""
        self.sessions.finish_session(
            status=status, best=best, trials_table=trials_table, baselines=baselines, budget_bytes=budget_bytes
        )

    def log_race(self, race: RaceResult) -> None:
        """Record the race on the session run (`SessionLog.log_race`)."""
        self.sessions.log_race(race)

    def note_session(self, notes: Sequence[str]) -> None:
        """Record what the session decided without a trial (`SessionLog.note_session`)."""
        self.sessions.note_session(notes)

    def close(self, status: str = "KILLED") -> None:
        """End the session run and its RUNNING children with ``status``; idempotent (`SessionLog.close`)."""
        self.sessions.close(status)

    def session(self, recipe: Recipe, *, study_name: str, resume: bool = True) -> AbstractContextManager[str]:
        """`start_session` ... `close`: FINISHED, KILLED on Ctrl-C, FAILED on any other exception."""
        return self.sessions.session(recipe, study_name=study_name, resume=resume)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.sessions.__exit__(exc_type, exc, tb)

    # ------------------------------------------------------------------ the good policy (`PolicyRegistry`)

    def current_good(self) -> GoodPolicy | None:
        """The experiment's current good policy, or ``None`` (`PolicyRegistry.current_good`)."""
        return self.registry.current_good()

    def restore_file(self, output_path: str | Path) -> str | None:
        """Make ``output_path`` hold the current good policy; what was wrong (`PolicyRegistry.restore_file`)."""
        return self.registry.restore_file(output_path)

    def end_dead_decisions(self, grace_s: float) -> list[str]:
        """End KILLED the RUNNING decision runs of dead owners; their ids (`PolicyRegistry.end_dead_decisions`)."""
        return self.registry.end_dead_decisions(grace_s)

    def clean_leftovers(self, output_path: str | Path, grace_s: float) -> tuple[str, ...]:
        """End dead decisions and remove their temporary files; what was done (`PolicyRegistry.clean_leftovers`)."""
        return self.registry.clean_leftovers(output_path, grace_s)

    def promote(
        self,
        policy: RecomputePolicy,
        *,
        source_run_id: str | None,
        output_path: str | Path,
        reason: str,
        evidence: Mapping[str, Any],
    ) -> str:
        """Make ``policy`` the good policy; the decision run id, nested in the open session run
        (`PolicyRegistry.promote`)."""
        return self.registry.promote(
            policy,
            source_run_id=source_run_id,
            output_path=output_path,
            reason=reason,
            evidence=evidence,
            parent_run_id=self.sessions.open_run_id,
        )

    def reject(
        self, policy: RecomputePolicy, *, source_run_id: str | None, reason: str, evidence: Mapping[str, Any]
    ) -> str:
        """Record that ``policy`` failed the gate; the decision run id, nested in the open session run
        (`PolicyRegistry.reject`)."""
        return self.registry.reject(
            policy,
            source_run_id=source_run_id,
            reason=reason,
            evidence=evidence,
            parent_run_id=self.sessions.open_run_id,
        )

    def can_roll_back(self) -> bool:
        """Whether an earlier good policy exists for `rollback` to restore (`PolicyRegistry.can_roll_back`)."""
        return self.registry.can_roll_back()

    def rollback(self, *, output_path: str | Path, vet: Callable[[GoodPolicy], None] | None = None) -> GoodPolicy:
        """Restore the good policy before the current one; the restored one, its decision run nested in the
        open session run (`PolicyRegistry.rollback`)."""
        return self.registry.rollback(output_path=output_path, vet=vet, parent_run_id=self.sessions.open_run_id)

    def history(self) -> list[Decision]:
        """Every completed promotion, rejection and rollback, oldest first (`PolicyRegistry.history`)."""
        return self.registry.history()


_log = logging.getLogger(__name__)


def open_tracker(tracking_uri: str, experiment: str, attempts: int = 5) -> Tracker:
    """The `Tracker` of ``experiment``, opened under the SQLite setup lock, retried on failure.

    Two workers starting at once against a new SQLite tracking database would both run MLflow's
    schema migration and fail on each other's half-made tables; the lock serialises that. The
    retry covers stores the lock cannot (no ``fcntl``; a server still starting).
    """
    from alembic.util.exc import CommandError
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    for attempt in range(1, attempts + 1):
        try:
            with sqlite_setup_lock(tracking_uri):
                return Tracker(tracking_uri, experiment)
        except (CommandError, MlflowException, SQLAlchemyError) as err:
            if attempt == attempts:
                raise
            _log.info("opening the MLflow store failed (%s); retrying", err)
            time.sleep(0.5 * attempt)
    raise AssertionError("unreachable")  # the loop returns or raises
