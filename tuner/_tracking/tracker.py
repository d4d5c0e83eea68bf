"""`Tracker`: the one object the tuner records through (session log and good-policy registry)."""

from __future__ import annotations

import logging
import time
from types import TracebackType

from tuner._stores import sqlite_setup_lock
from tuner._tracking.client import TrackingClient
from tuner._tracking.registry import PolicyRegistry
from tuner._tracking.sessions import SessionLog

__all__ = ["Tracker", "open_tracker"]


class Tracker:
    """The experiment's MLflow records: ``sessions`` (a `SessionLog`: the session run and the runs nested in
    it) and ``registry`` (a `PolicyRegistry`: the good policy and its decisions), sharing one client
    (``store``). A decision made while a session is open nests in its run.

    Use it as a context manager so the session run always ends: FINISHED on a normal exit, KILLED on
    Ctrl-C, FAILED on an exception::

        with Tracker(recipe.tracking.uri, recipe.tracking.experiment) as tracker:
            tracker.sessions.start_session(recipe, study_name=study.study_name)
            tracker.registry.promote(policy, ...)

    Args:
        tracking_uri: the MLflow tracking URI.
        experiment: the experiment name (one per recipe); created when missing (`artifact_location_for`).
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
        self.sessions = SessionLog(self.store)
        self.registry = PolicyRegistry(self.store, self.sessions)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.sessions.__exit__(exc_type, exc, tb)


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
