"""MLflow records of tuning: session runs, trial runs, and the good-policy decisions.

Layout (one experiment per recipe; the names are in `tuner._tracking.names` and `lightning_recompute.mlflow_policy`):

- **session run** (``recompute.kind=session``, ``recompute.study``): the recipe (``recipe.yaml``, ``recipe.*``
  params); at the end ``best_policy.yaml``, ``best.json``, ``trials.json``, ``trials.csv``, ``baselines.json``,
  ``pareto.png`` and a markdown summary as its description.
- **trial run**, nested in it (``recompute.kind=trial``, ``recompute.outcome``): a ``layer.<path>`` param per
  layer, ``micro_batch``, ``policy_fingerprint``, ``trial_number``; ``measured_*``/``predicted_*`` metrics;
  ``policy.yaml``. A **confirmation run** (the gate's, ``recompute.kind=confirmation``) has the same shape.
- **decision run** (``recompute.kind=decision``, ``recompute.decision=promote|reject|rollback``): reason,
  previous and new good run, ``recompute.decision_seq``; ``policy.yaml`` and ``evidence.json``.
- the experiment tag ``recompute.good_run_id`` names the run holding the good policy (what
  `lightning_recompute.mlflow_policy.load_good_policy` reads); that run carries ``recompute.good=true``.

Every call names its run by id, never MLflow's global active run, so resumed sessions, gates and several
workers do not step on each other.
"""

from __future__ import annotations

import logging
import time
from types import TracebackType

from tuner._stores import sqlite_setup_lock
from tuner._tracking.client import (
    DEFAULT_TRACKING_URI,
    ExperimentNotFound,
    TrackingClient,
    TrackingError,
    artifact_location_for,
)
from tuner._tracking.registry import Decision, GoodPolicy, PolicyRegistry
from tuner._tracking.sessions import SessionLog

__all__ = [
    "DEFAULT_TRACKING_URI",
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
    """The experiment's records: ``sessions`` (`SessionLog`) and ``registry`` (`PolicyRegistry`) sharing one
    client (``store``); a decision made while a session is open nests in its run. As a context manager the
    session run always ends: FINISHED, KILLED on Ctrl-C, FAILED on an exception."""

    def __init__(self, tracking_uri: str | None, experiment: str, *, create: bool = True) -> None:
        self.store = TrackingClient(tracking_uri, experiment, create=create)
        self.sessions = SessionLog(self.store)
        self.registry = PolicyRegistry(self.store, self.sessions)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, _type: type[BaseException] | None, exc: BaseException | None, _tb: TracebackType | None) -> None:
        self.sessions.end(exc)


def open_tracker(tracking_uri: str, experiment: str, attempts: int = 5) -> Tracker:
    """The `Tracker` of ``experiment``, opened under the SQLite setup lock (two workers migrating a new database
    at once fail on each other's tables), retried for stores the lock cannot cover."""
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
