"""Read the tuner's current good policy from MLflow (``policy="mlflow:<experiment>"``) with mlflow alone: the
names below are the contract the tuner imports; reading never creates a missing local store."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from lightning_recompute.errors import PolicyError
from lightning_recompute.policy import RecomputePolicy

GOOD_RUN_TAG = "recompute.good_run_id"
"""Experiment tag: the id of the run whose policy is the current good one."""
POLICY_ARTIFACT = "policy.yaml"
FINGERPRINT_TAG = "recompute.policy_fingerprint"
"""Run tag: ``RecomputePolicy.fingerprint()`` of the policy the run measured or decided about."""

_PROGRESS_BAR_ENV = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
_SQLITE = "sqlite:///"


def good_run_id(experiment: str, tracking_uri: str | None = None) -> str:
    """The id of the run holding the current good policy of ``experiment``."""
    client, where = _client(experiment, tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise PolicyError(f"{where}: no MLflow experiment named {experiment!r}; run `recompute-tune` on a recipe first")
    if exp.lifecycle_stage != "active":
        raise PolicyError(f"{where}: experiment {experiment!r} is deleted; restore it or name another experiment")
    run_id = exp.tags.get(GOOD_RUN_TAG)
    if not run_id:
        raise PolicyError(
            f"{where}: experiment {experiment!r} has no good policy yet (tag {GOOD_RUN_TAG} is not set); "
            f"a tuning session sets it when it promotes a policy"
        )
    return run_id


def load_good_policy(experiment: str, tracking_uri: str | None = None) -> RecomputePolicy:
    """The current good policy of ``experiment``, as the tuner last promoted or rolled back to it; a `PolicyError`
    when missing, invalid, or not the fingerprint its run recorded in `FINGERPRINT_TAG` (untagged runs load)."""
    from mlflow.exceptions import MlflowException

    client, where = _client(experiment, tracking_uri)
    run_id = good_run_id(experiment, tracking_uri=client.tracking_uri)
    try:
        run = client.get_run(run_id)
    except MlflowException as err:
        raise PolicyError(
            f"{where}: tag {GOOD_RUN_TAG} names run {run_id}, which does not exist ({err.error_code})"
        ) from None
    if run.info.lifecycle_stage != "active":
        raise PolicyError(f"{where}: tag {GOOD_RUN_TAG} names run {run_id}, which is deleted")
    moved, good = _moved_artifacts(client.tracking_uri, run.info.artifact_uri), f"{where}: good run {run_id}"
    with tempfile.TemporaryDirectory(prefix="recompute-policy-") as tmp, _no_progress_bar():
        try:
            if moved is None:
                local = Path(client.download_artifacts(run_id, POLICY_ARTIFACT, tmp))
            elif not (local := moved / POLICY_ARTIFACT).is_file():
                raise FileNotFoundError(local)
        except (MlflowException, OSError) as err:
            raise PolicyError(f"{good} has no artifact {POLICY_ARTIFACT!r} ({type(err).__name__})") from None
        try:
            policy = RecomputePolicy.load(local)
        except PolicyError as err:
            message = str(err).replace(str(local), POLICY_ARTIFACT)
            raise PolicyError(f"{good}: artifact {POLICY_ARTIFACT!r} is not a valid policy: {message}") from None
    expected = run.data.tags.get(FINGERPRINT_TAG)
    if expected and policy.fingerprint() != expected:
        raise PolicyError(
            f"{good}: artifact {POLICY_ARTIFACT!r} has fingerprint {policy.fingerprint()}, "
            f"but the run recorded {expected} (tag {FINGERPRINT_TAG}); the artifact was changed after the run "
            f"logged it. Roll back with `recompute-tune rollback`, or re-run the tuner"
        )
    return policy


def _moved_artifacts(tracking_uri: str, artifact_uri: str) -> Path | None:
    """A run's artifact folder beside its SQLite database when the folder holding both moved (MLflow records
    absolute paths); ``None``: not moved."""
    recorded = artifact_uri.removeprefix("file://")
    if not tracking_uri.startswith(_SQLITE) or "://" in recorded or ":" in recorded.split("/", 1)[0]:
        return None
    parts = Path(recorded).parts
    if Path(recorded).exists() or "mlartifacts" not in parts:
        return None
    tail = parts[len(parts) - parts[::-1].index("mlartifacts") :]
    here = Path(tracking_uri[len(_SQLITE) :]).expanduser().resolve().parent.joinpath("mlartifacts", *tail)
    return here if here.is_dir() else None


def _client(experiment: str, tracking_uri: str | None) -> tuple[Any, str]:
    """An MLflow client, and how messages name the source; refuses a local store that does not exist."""
    import mlflow  # here: heavy, and only users of "mlflow:" policies need it

    uri = tracking_uri or mlflow.get_tracking_uri()
    where = f"mlflow:{experiment} (tracking URI {uri})"
    missing = _missing_local_store(uri)
    if missing is not None:
        raise PolicyError(
            f"{where}: {missing} does not exist; check the path (sqlite:///relative/path.db, "
            f"sqlite:////absolute/path.db); reading a policy never creates a store"
        )
    return mlflow.MlflowClient(tracking_uri=uri), where


def _missing_local_store(uri: str) -> Path | None:
    """The local sqlite file or store folder ``uri`` names when it does not exist (MLflow would create it)."""
    if uri.startswith(_SQLITE):
        # sqlite:///rel.db is relative, sqlite:////abs.db absolute; SQLAlchemy keeps query options after "?".
        name = uri[len(_SQLITE) :].split("?", 1)[0]
        path = None if name in ("", ":memory:") else Path(name)
    elif (parsed := urlparse(uri)).scheme == "file":
        path = Path(url2pathname(parsed.path))
    elif parsed.scheme == "" or (len(parsed.scheme) == 1 and os.name == "nt"):  # a bare path (C:\ on Windows)
        path = Path(uri)
    else:
        return None  # a server or another database: MLflow reports its own errors
    return None if path is None or path.exists() else path


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    """MLflow's download progress bar off unless the user's environment sets it; no other key is touched (a training
    job's environment is not reset around the download)."""
    ours = _PROGRESS_BAR_ENV not in os.environ
    os.environ.setdefault(_PROGRESS_BAR_ENV, "false")
    try:
        yield
    finally:
        if ours:
            os.environ.pop(_PROGRESS_BAR_ENV, None)
