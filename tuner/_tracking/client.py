"""The MLflow client the tracking modules share: the experiment, run search, batched logging, and MLflow's limits."""

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

from lightning_recompute.units import jsonable
from tuner.exits import EXIT_BAD_INPUT, Declined

if TYPE_CHECKING:
    from mlflow import MlflowClient

_log = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"

_BAD_NAME_CHARS = re.compile(r"[^/\w.\- :]")
_MAX_TAG = 5000  # below MLflow's 8000-character tag limit, with room for a multi-byte encoding


class TrackingError(Declined):
    """The MLflow record cannot do what was asked; the command changes nothing (exit 1)."""


class ExperimentNotFound(TrackingError):
    """A reader named an experiment the tracking store does not have (bad input: exit 2)."""

    exit_code: ClassVar[int] = EXIT_BAD_INPUT


def artifact_location_for(tracking_uri: str, experiment: str) -> str | None:
    """``<db folder>/mlartifacts/<experiment>`` for a sqlite store (MLflow's default is the working directory's
    ``./mlartifacts``); ``None`` leaves the choice to other stores."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db = tracking_uri[len("sqlite:///") :]
    if not db or db == ":memory:":
        return None
    safe = re.sub(r"[^\w.\-]+", "_", experiment).strip("._") or "experiment"
    return str(Path(db).resolve().parent / "mlartifacts" / safe)


def _follow_a_moved_folder(tracking_uri: str, experiment: str, exp: Any) -> None:
    """Point a moved or copied results folder's records (experiment and run artifact locations) at its own
    ``mlartifacts``; MLflow stores absolute locations and has no API to change them, so this is an SQL UPDATE.
    A location the user chose (another folder name, a server) is left alone."""
    expected = artifact_location_for(tracking_uri, experiment)
    if expected is None:
        return
    stored = str(exp.artifact_location)
    stored_path = stored[len("file://") :] if stored.startswith("file://") else stored
    if stored_path == expected or Path(stored_path).name != Path(expected).name:
        return
    if Path(stored_path).parent.name != "mlartifacts":
        return  # not the tuner's layout: someone chose this location
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


def param_key(name: str) -> str:
    """``name`` as an MLflow param or metric key: characters MLflow rejects become ``_``, cut to 250."""
    return _BAD_NAME_CHARS.sub("_", name)[:250]


def clip_tag(text: Any, limit: int = _MAX_TAG) -> str:
    """``str(text)`` cut to fit an MLflow tag (or ``limit`` characters), marked when cut."""
    s = str(text)
    return s if len(s) <= limit else s[: limit - 15] + " ...[truncated]"


def now_ms() -> int:
    return int(time.time() * 1000)


def finite(value: Any) -> float | None:
    """A real number as a float, or ``None`` for anything else (a bool, a string, NaN, infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


class TrackingClient:
    """One MLflow experiment, reached through `mlflow.MlflowClient` by run id (never the global active run).

    ``create=False`` (readers) raises `ExperimentNotFound` for a missing experiment instead of creating it.
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
        _follow_a_moved_folder(self.tracking_uri, self.experiment, exp)
        return exp.experiment_id

    def _not_found(self) -> str:
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
    ) -> None:
        """Log params, metrics and tags to ``run_id`` in batches MLflow accepts (keys and tags clipped)."""
        from mlflow.entities import Metric, RunTag

        ts = now_ms()
        ms = [Metric(param_key(k), float(v), ts, 0) for k, v in (metrics or {}).items()]
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
