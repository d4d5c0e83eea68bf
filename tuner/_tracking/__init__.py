"""MLflow records of tuning: session, trial and decision runs, and the good policy (names: `tuner._tracking.names`).
Every call names its run by id, never MLflow's global active run, so resumed sessions, gates and several workers
do not step on each other."""

from __future__ import annotations

import logging
import time
from types import TracebackType

from tuner._stores import sqlite_setup_lock
from tuner._tracking.client import ExperimentNotFound, TrackingClient, TrackingError, artifact_location_for
from tuner._tracking.registry import Decision, GoodPolicy, PolicyRegistry
from tuner._tracking.sessions import SessionLog

__all__ = [
    "Decision",
    "ExperimentNotFound",
    "GoodPolicy",
    "Tracker",
    "TrackingError",
    "artifact_location_for",
    "open_tracker",
]

_log = logging.getLogger(__name__)


class Tracker:
    """The experiment's ``sessions`` and ``registry`` sharing one client (``store``); a decision made while a session
    is open nests in its run. As a context manager the session run always ends (`SessionLog.end`)."""

    def __init__(self, tracking_uri: str, experiment: str, *, create: bool = True) -> None:
        self.store = TrackingClient(tracking_uri, experiment, create=create)
        self.sessions = SessionLog(self.store)
        self.registry = PolicyRegistry(self.store, self.sessions)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, _type: type[BaseException] | None, exc: BaseException | None, _tb: TracebackType | None) -> None:
        self.sessions.end(exc)


def open_tracker(tracking_uri: str, experiment: str) -> Tracker:
    """The `Tracker` of ``experiment``, opened under the SQLite setup lock (two workers migrating a new database
    at once fail on each other's tables), retried for stores the lock cannot cover."""
    from alembic.util.exc import CommandError
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    for attempt in range(1, 5):
        try:
            with sqlite_setup_lock(tracking_uri):
                return Tracker(tracking_uri, experiment)
        except (CommandError, MlflowException, SQLAlchemyError) as err:
            _log.info("opening the MLflow store failed (%s); retrying", err)
            time.sleep(0.5 * attempt)
    with sqlite_setup_lock(tracking_uri):  # the fifth try raises what fails
        return Tracker(tracking_uri, experiment)
