"""The MLflow client the tracking modules share: the experiment, run search, batched logging,
and the clipping rules MLflow's limits impose."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from tuner.exits import EXIT_BAD_INPUT, Declined

if TYPE_CHECKING:
    from mlflow import MlflowClient

from lightning_recompute.units import jsonable

_log = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
"""Where runs go unless the recipe says otherwise (MLflow 3 deprecates the file store)."""


_BAD_NAME_CHARS = re.compile(r"[^/\w.\- :]")
_MAX_TAG = 5000  # below MLflow's 8000-character tag limit, with room for a multi-byte encoding


class TrackingError(Declined):
    """The MLflow record cannot do what was asked (no session, nothing to roll back to, an inconsistent record):
    the command changes nothing (exit 1)."""


class ExperimentNotFound(TrackingError):
    """A reader (``history``, ``rollback``) named an experiment the tracking store does not have (bad input: exit 2)."""

    exit_code: ClassVar[int] = EXIT_BAD_INPUT


def artifact_location_for(tracking_uri: str, experiment: str) -> str | None:
    """Where a new experiment keeps artifacts: ``<db folder>/mlartifacts/<experiment>`` for sqlite.

    A sqlite store has no folder of its own, and MLflow's default would be ``./mlartifacts`` in
    whatever directory the tuner (or a test) runs from. ``None`` leaves the choice to the store
    (a tracking server, a file store).
    """
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db = tracking_uri[len("sqlite:///") :]
    if not db or db == ":memory:":
        return None
    safe = re.sub(r"[^\w.\-]+", "_", experiment).strip("._") or "experiment"
    return str(Path(db).resolve().parent / "mlartifacts" / safe)


def _follow_a_moved_folder(tracking_uri: str, experiment: str, exp: Any) -> str | None:
    """Point a moved or copied results folder's records at its own artifacts; the old location, if it did.

    MLflow stores absolute artifact locations: the experiment's, and each run's under it. After
    ``mv run1 run2`` the database in run2 still names run1's ``mlartifacts``, so reading a policy
    fails and logging recreates run1's folder; a copy would write into the original's. When the
    experiment's recorded location is the one `artifact_location_for` gave the database's
    *former* folder, the records (the experiment's location and its runs' artifact URIs) are
    rewritten to the database's current folder, in one transaction. MLflow has no API for this,
    so it is an UPDATE of the two columns that hold the locations. A location the user chose
    (another folder name, a server) is left alone.
    """
    expected = artifact_location_for(tracking_uri, experiment)
    if expected is None:
        return None
    stored = str(exp.artifact_location)
    stored_path = stored[len("file://") :] if stored.startswith("file://") else stored
    if stored_path == expected or Path(stored_path).name != Path(expected).name:
        return None
    if Path(stored_path).parent.name != "mlartifacts":
        return None  # not the tuner's layout: someone chose this location
    import sqlite3

    db = tracking_uri[len("sqlite:///") :]
    prefix = stored.rstrip("/")
    with contextlib.closing(sqlite3.connect(db, timeout=120)) as conn, conn:
        conn.execute(
            "UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?", (expected, int(exp.experiment_id))
        )
        conn.execute(
            "UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) "
            "WHERE experiment_id = ? AND substr(artifact_uri, 1, ?) = ?",
            (expected, len(prefix) + 1, int(exp.experiment_id), len(prefix), prefix),
        )
    _log.warning(
        "the results folder moved: experiment %r's artifacts were recorded under %s; now under %s",
        experiment,
        stored_path,
        expected,
    )
    return stored_path


def param_key(name: str) -> str:
    """``name`` as an MLflow param or metric key: characters MLflow rejects become ``_``, cut to 250."""
    # MLflow rejects brackets, '*', '?' etc. in keys; layer paths rarely have them, patterns do.
    return _BAD_NAME_CHARS.sub("_", name)[:250]


def clip_tag(text: Any, limit: int = _MAX_TAG) -> str:
    """``str(text)`` cut to fit an MLflow tag (or ``limit`` characters), marked when cut."""
    s = str(text)
    return s if len(s) <= limit else s[: limit - 15] + " ...[truncated]"


def now_ms() -> int:
    """The time now in milliseconds since the epoch, as MLflow timestamps are."""
    return int(time.time() * 1000)


def finite(value: Any) -> float | None:
    """A real number as a float, or ``None`` for anything else (a bool, a string, NaN, infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def int_or_none(value: Any) -> int | None:
    """A finite number as an int (truncated), else ``None``."""
    v = finite(value)
    return None if v is None else int(v)


class TrackingClient:
    """One MLflow experiment, reached through `mlflow.MlflowClient` by run id (never the global active run).

    Args:
        tracking_uri: the MLflow tracking URI (``sqlite:///mlflow.db`` by default in recipes).
        experiment: the experiment name (one per recipe); created when missing, with artifacts
            under the sqlite database's folder (`artifact_location_for`).
        artifact_location: overrides where a newly created experiment keeps artifacts.
        create: create the experiment when it is missing; ``False`` for commands that only read
            or restore (a misspelt name must not become a new, empty experiment).

    Raises:
        ExperimentNotFound: ``create`` is ``False`` and the store has no experiment of that name.
    """

    def __init__(
        self,
        tracking_uri: str | None,
        experiment: str,
        *,
        artifact_location: str | None = None,
        create: bool = True,
    ) -> None:
        import mlflow

        if not isinstance(experiment, str) or not experiment.strip():
            raise TrackingError(f"experiment: must be a non-empty name, got {experiment!r}")
        self.tracking_uri = tracking_uri or DEFAULT_TRACKING_URI
        self.experiment = experiment
        self.client: MlflowClient = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        self.relocated_from: str | None = None
        """The artifact folder the experiment was recorded under before its results folder moved."""
        self.experiment_id = self._experiment_id(artifact_location, create)

    def _experiment_id(self, artifact_location: str | None, create: bool) -> str:
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is None and not create:
            raise ExperimentNotFound(self._not_found())
        if exp is None:
            location = artifact_location or artifact_location_for(self.tracking_uri, self.experiment)
            try:
                return self.client.create_experiment(self.experiment, artifact_location=location)
            except MlflowException as err:
                # Another worker created it between our lookup and create: use theirs.
                exp = self.client.get_experiment_by_name(self.experiment)
                if exp is None:
                    raise TrackingError(f"cannot create MLflow experiment {self.experiment!r}: {err}") from err
        if exp.lifecycle_stage != "active":
            raise TrackingError(
                f"MLflow experiment {self.experiment!r} is deleted; restore it (`mlflow experiments restore "
                f"--experiment-id {exp.experiment_id}`) or set tracking.experiment to another name"
            )
        self.relocated_from = _follow_a_moved_folder(self.tracking_uri, self.experiment, exp)
        return exp.experiment_id

    def _not_found(self) -> str:
        """The message for a missing experiment: the store, and the experiments it does have."""
        from tuner._stores import hide_password

        names = sorted(e.name for e in self.client.search_experiments() if e.name != "Default")
        valid = ", ".join(repr(n) for n in names) if names else "none yet"
        return (
            f"tracking.experiment: {clip_tag(repr(self.experiment), 200)} is not an experiment in "
            f"{clip_tag(hide_password(self.tracking_uri), 200)} (valid: {clip_tag(valid, 1000)}); check the spelling, "
            f"or tune the recipe first (`recompute-tune RECIPE` creates it)"
        )

    def search(self, filter_string: str) -> list[Any]:
        """Every active run of the experiment matching ``filter_string`` (all pages)."""
        from mlflow.entities import ViewType

        runs: list[Any] = []
        token = None
        while True:
            page = self.client.search_runs(
                [self.experiment_id],
                filter_string=filter_string,
                run_view_type=ViewType.ACTIVE_ONLY,
                max_results=1000,
                page_token=token,
            )
            runs.extend(page)
            token = page.token
            if not token:
                return runs

    def log_batch(
        self,
        run_id: str,
        *,
        params: Sequence[Any] = (),
        metrics: Mapping[str, float] | None = None,
        tags: Mapping[str, str] | None = None,
        step: int = 0,
    ) -> None:
        """Log params, metrics and tags to ``run_id`` in batches MLflow accepts (keys and tags clipped)."""
        from mlflow.entities import Metric, RunTag

        ts = now_ms()
        ms = [Metric(param_key(k), float(v), ts, step) for k, v in (metrics or {}).items()]
        ts_list = [RunTag(k, clip_tag(v)) for k, v in (tags or {}).items()]
        params = list(params)
        # MLflow caps a batch at 100 params/tags and 1000 metrics (a 126-layer model has more).
        for i in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[i : i + 100])
        for i in range(0, len(ts_list), 100):
            self.client.log_batch(run_id, tags=ts_list[i : i + 100])
        for i in range(0, len(ms), 1000):
            self.client.log_batch(run_id, metrics=ms[i : i + 1000])

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        """Set several tags of ``run_id`` at once (each clipped to MLflow's limit)."""
        self.log_batch(run_id, tags=tags)

    def log_json(self, run_id: str, name: str, data: Any) -> None:
        """Log ``data`` as the JSON artifact ``name`` of ``run_id`` (strict JSON: no NaN)."""
        self.client.log_text(run_id, json.dumps(jsonable(data), indent=2, allow_nan=False), name)
