"""The MLflow client the tracking modules share: the experiment, run search, runs that always end, MLflow's limits."""

from __future__ import annotations

import contextlib
import logging
import math
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from tuner.exits import EXIT_BAD_INPUT, Declined

if TYPE_CHECKING:
    from mlflow import MlflowClient

_log = logging.getLogger(__name__)


class TrackingError(Declined):
    """The MLflow record cannot do what was asked; the command changes nothing (exit 1)."""


class ExperimentNotFound(TrackingError):
    """A reader named an experiment the tracking store does not have (bad input: exit 2)."""

    exit_code: ClassVar[int] = EXIT_BAD_INPUT


def artifact_location_for(tracking_uri: str, experiment: str) -> str | None:
    """``<db folder>/mlartifacts/<experiment>`` for a sqlite store (MLflow's default is the working directory's
    ``./mlartifacts``); ``None`` leaves the choice to other stores."""
    db = tracking_uri[len("sqlite:///") :] if tracking_uri.startswith("sqlite:///") else ""
    if not db or db == ":memory:":
        return None
    safe = re.sub(r"[^\w.\-]+", "_", experiment).strip("._") or "experiment"
    return str(Path(db).resolve().parent / "mlartifacts" / safe)


def param_key(name: str) -> str:
    """``name`` as an MLflow param or metric key: characters MLflow rejects become ``_``, cut to 250."""
    return re.sub(r"[^/\w.\- :]", "_", name)[:250]


def clip_tag(text: Any, limit: int = 5000) -> str:
    """``str(text)`` cut to fit an MLflow tag (8000 characters, less room for multi-byte text), marked when cut."""
    s = str(text)
    return s if len(s) <= limit else s[: limit - 15] + " ...[truncated]"


def finite(value: Any) -> float | None:
    """A real number as a float, or ``None`` for anything else (a bool, a string, NaN, infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


class TrackingClient:
    """One MLflow experiment, reached through `mlflow.MlflowClient` by run id (never the global active run).
    ``create=False`` (readers) raises `ExperimentNotFound` for a missing experiment instead of creating it."""

    def __init__(self, tracking_uri: str, experiment: str, *, create: bool = True) -> None:
        import mlflow
        from mlflow.exceptions import MlflowException

        if not isinstance(experiment, str) or not experiment.strip():
            raise TrackingError(f"experiment: must be a non-empty name, got {experiment!r}")
        self.tracking_uri, self.experiment = tracking_uri, experiment
        self.client: MlflowClient = mlflow.MlflowClient(tracking_uri=tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None and not create:
            from tuner._stores import hide_password

            names = sorted(e.name for e in self.client.search_experiments() if e.name != "Default")
            valid = ", ".join(repr(n) for n in names) if names else "none yet"
            raise ExperimentNotFound(
                f"tracking.experiment: {clip_tag(repr(experiment), 200)} is not an experiment in "
                f"{clip_tag(hide_password(tracking_uri), 200)} (valid: {clip_tag(valid, 1000)}); check the "
                f"spelling, or tune the recipe first (`recompute-tune RECIPE` creates it)"
            )
        if exp is None:
            location = artifact_location_for(tracking_uri, experiment)
            try:
                self.experiment_id: str = self.client.create_experiment(experiment, artifact_location=location)
                return
            except MlflowException as err:
                # Another worker created it between our lookup and create: use theirs.
                exp = self.client.get_experiment_by_name(experiment)
                if exp is None:
                    raise TrackingError(f"cannot create MLflow experiment {experiment!r}: {err}") from err
        if exp.lifecycle_stage != "active":
            raise TrackingError(
                f"MLflow experiment {experiment!r} is deleted; restore it (`mlflow experiments restore "
                f"--experiment-id {exp.experiment_id}`) or set tracking.experiment to another name"
            )
        self._follow_a_moved_folder(exp)
        self.experiment_id = exp.experiment_id

    def _follow_a_moved_folder(self, exp: Any) -> None:
        """Point a moved or copied results folder's records (experiment and run artifact locations) at its own
        ``mlartifacts``; MLflow stores absolute locations and has no API to change them, so this is an SQL UPDATE.
        A location the user chose (another folder name, a server) is left alone."""
        import sqlite3

        expected = artifact_location_for(self.tracking_uri, self.experiment)
        stored = str(exp.artifact_location)
        stored_path = Path(stored.removeprefix("file://"))
        tuners = stored_path.parent.name == "mlartifacts" and stored_path.name == Path(expected or "").name
        if expected is None or str(stored_path) == expected or not tuners:
            return  # in place, or not the tuner's layout: someone chose this location
        prefix, exp_id = stored.rstrip("/"), int(exp.experiment_id)
        with contextlib.closing(sqlite3.connect(self.tracking_uri[len("sqlite:///") :], timeout=120)) as conn, conn:
            conn.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?", (expected, exp_id))
            conn.execute(
                "UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) "
                "WHERE experiment_id = ? AND substr(artifact_uri, 1, ?) = ?",
                (expected, len(prefix) + 1, exp_id, len(prefix), prefix),
            )
        moved = f"experiment {self.experiment!r}'s artifacts were recorded under {stored_path}; now under {expected}"
        _log.warning("the results folder moved: %s", moved)

    def search(self, filter_string: str) -> list[Any]:
        """Every active run of the experiment matching ``filter_string`` (all pages)."""
        runs: list[Any] = []
        token = None
        while True:
            page = self.client.search_runs([self.experiment_id], filter_string, max_results=1000, page_token=token)
            runs.extend(page)
            token = page.token
            if not token:
                return runs

    @contextlib.contextmanager
    def run(
        self, name: str, tags: Mapping[str, str | None], *, end: str = "FINISHED", start_time: int | None = None
    ) -> Iterator[str]:
        """A new run of the experiment (tags clipped, ``None`` ones left out), ended ``end`` after the block and
        FAILED when it raises; its id."""
        kept = {k: clip_tag(v) for k, v in tags.items() if v is not None}
        run_id = self.client.create_run(self.experiment_id, start_time=start_time, tags=kept, run_name=name).info.run_id
        try:
            yield run_id
        except BaseException:
            self.client.set_terminated(run_id, "FAILED")
            raise
        self.client.set_terminated(run_id, end)

    def log_batch(
        self,
        run_id: str,
        *,
        params: Mapping[str, str] | None = None,
        metrics: Mapping[str, float] | None = None,
        tags: Mapping[str, str] | None = None,
        step_times: Sequence[float] = (),
    ) -> None:
        """Log params, metrics (``step_times`` as the ``step_time_s`` metric's steps) and tags to ``run_id``, keys
        and tags clipped to MLflow's limits (`MlflowClient.log_batch` splits what one request cannot take)."""
        from mlflow.entities import Metric, Param, RunTag

        ts = int(time.time() * 1000)
        ms = [Metric(param_key(k), float(v), ts, 0) for k, v in (metrics or {}).items()]
        ms += [Metric("step_time_s", float(s), ts, i) for i, s in enumerate(step_times) if finite(s) is not None]
        self.client.log_batch(
            run_id,
            metrics=ms,
            params=[Param(param_key(k), v) for k, v in (params or {}).items()],
            tags=[RunTag(k, clip_tag(v)) for k, v in (tags or {}).items()],
        )
