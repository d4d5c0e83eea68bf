"""`Tracker`: the one object the tuner records through (session log and good-policy registry)."""

from __future__ import annotations

from tuner.tracking.registry import PolicyRegistry
from tuner.tracking.sessions import SessionLog

__all__ = ["Tracker"]


class Tracker(SessionLog, PolicyRegistry):
    """MLflow bookkeeping of tuning sessions (`SessionLog`) and of the experiment's good policy (`PolicyRegistry`).

    Use it as a context manager (or `session`) so the session run always ends: FINISHED on a
    normal exit, KILLED on Ctrl-C, FAILED on an exception, and never stays RUNNING::

        with Tracker(recipe.tracking.uri, recipe.tracking.experiment) as tracker:
            tracker.start_session(recipe, study_name=study.study_name)
            tracker.log_trial(0, policy, names, None, result)
            rows = [r.to_dict() for r in study.records()]  # the trials table: `TrialRecord.to_dict` rows
            tracker.finish_session(status="FINISHED", best=..., trials_table=rows, baselines={}, budget_bytes=limit)

    A decision (promote, reject, rollback) made while a session is open nests in its run.

    Args:
        tracking_uri: the MLflow tracking URI (``sqlite:///mlflow.db`` by default in recipes).
        experiment: the experiment name (one per recipe); created when missing, with artifacts
            under the sqlite database's folder (`artifact_location_for`).
        artifact_location: overrides where a newly created experiment keeps artifacts.
        create: create the experiment when missing (``False``: raise `ExperimentNotFound`, for readers).
    """
