"""Read the tuner's current good policy from MLflow: ``RecomputeCallback(policy="mlflow:<experiment>")``.

The tuner (``tuner.tracking``) records which run holds the current good policy in the experiment
tag `GOOD_RUN_TAG`, and stores the policy in that run as the artifact `POLICY_ARTIFACT`. This
module reads both with mlflow alone: the plugin runs inside training jobs and never imports the
tuner. The names below are the contract between the two sides; the tuner imports them from here.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from lightning_recompute.errors import PolicyError
from lightning_recompute.policy import RecomputePolicy

__all__ = ["GOOD_RUN_TAG", "POLICY_ARTIFACT", "good_run_id", "load_good_policy"]

GOOD_RUN_TAG = "recompute.good_run_id"
"""Experiment tag: the id of the run whose policy is the current good one."""
POLICY_ARTIFACT = "policy.yaml"
"""Artifact path of a run's policy file (the same YAML the tuner writes as its output)."""


def good_run_id(experiment: str, tracking_uri: str | None = None) -> str:
    """The id of the run holding the current good policy of ``experiment``.

    Raises:
        PolicyError: the experiment does not exist, is deleted, or has no good policy yet.
    """
    client = _client(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    where = f"mlflow:{experiment} (tracking URI {client.tracking_uri})"
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
    """The current good policy of ``experiment``, as the tuner last promoted (or rolled back to) it.

    Args:
        experiment: the MLflow experiment the tuner logs to (the recipe's ``tracking.experiment``).
        tracking_uri: the MLflow tracking URI; ``None`` uses MLflow's default (``MLFLOW_TRACKING_URI``).

    Raises:
        PolicyError: the experiment, its good-run tag, the run, or the run's policy artifact does not
            exist, or the artifact is not a valid policy. The message names which.
    """
    from mlflow.exceptions import MlflowException

    client = _client(tracking_uri)
    run_id = good_run_id(experiment, tracking_uri=client.tracking_uri)
    where = f"mlflow:{experiment} (tracking URI {client.tracking_uri})"
    try:
        run = client.get_run(run_id)
    except MlflowException as err:
        raise PolicyError(
            f"{where}: tag {GOOD_RUN_TAG} names run {run_id}, which does not exist ({err.error_code})"
        ) from None
    if run.info.lifecycle_stage != "active":
        raise PolicyError(f"{where}: tag {GOOD_RUN_TAG} names run {run_id}, which is deleted")
    with tempfile.TemporaryDirectory(prefix="recompute-policy-") as tmp:
        try:
            local = client.download_artifacts(run_id, POLICY_ARTIFACT, tmp)
        except (MlflowException, OSError) as err:
            raise PolicyError(
                f"{where}: good run {run_id} has no artifact {POLICY_ARTIFACT!r} ({type(err).__name__})"
            ) from None
        try:
            return RecomputePolicy.load(Path(local))
        except PolicyError as err:
            # The temporary path in err means nothing to the user; the run and artifact do.
            raise PolicyError(
                f"{where}: good run {run_id}: artifact {POLICY_ARTIFACT!r} is not a valid policy: {err}"
            ) from None


def _client(tracking_uri: str | None) -> Any:
    # Imported here: mlflow is heavy, and only users of "mlflow:" policies need it.
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)
