"""lightning_recompute.mlflow_policy: the good policy read back with mlflow alone (no tuner import)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from lightning_recompute.errors import PolicyError, RecomputeError
from lightning_recompute.mlflow_policy import (
    FINGERPRINT_TAG,
    GOOD_RUN_TAG,
    POLICY_ARTIFACT,
    good_run_id,
    load_good_policy,
)
from lightning_recompute.policy import RecomputePolicy
from tests.helpers import REPO

POLICY = RecomputePolicy.from_dict(
    {
        "version": 1,
        "layers": {"blocks.0": "none", "blocks.[1-2]": "selective", "blocks.*": "full"},
        "selective": {"save": ["aten.mm"]},
    }
)


def good_experiment(
    uri: str,
    tmp_path: Path,
    *,
    policy_text: str | None = POLICY.to_yaml(),
    tag: bool = True,
    fingerprint: str | None = POLICY.fingerprint(),
) -> str:
    """An experiment laid out as the tuner leaves it: a run with policy.yaml and its fingerprint tag,
    named by the experiment tag."""
    client = MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment("exp", artifact_location=str(tmp_path / "artifacts"))
    tags = {} if fingerprint is None else {FINGERPRINT_TAG: fingerprint}
    run_id = client.create_run(exp_id, tags=tags).info.run_id
    if policy_text is not None:
        client.log_text(run_id, policy_text, POLICY_ARTIFACT)
    client.set_terminated(run_id)
    if tag:
        client.set_experiment_tag(exp_id, GOOD_RUN_TAG, run_id)
    return run_id


def test_round_trip(uri: str, tmp_path: Path) -> None:
    run_id = good_experiment(uri, tmp_path)
    assert good_run_id("exp", uri) == run_id
    loaded = load_good_policy("exp", uri)
    assert loaded == POLICY
    assert loaded.fingerprint() == POLICY.fingerprint()


def test_default_tracking_uri_comes_from_the_environment(
    uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good_experiment(uri, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert load_good_policy("exp") == POLICY


def test_missing_experiment_names_it(uri: str) -> None:
    with pytest.raises(PolicyError, match=r"no MLflow experiment named 'nope'") as info:
        load_good_policy("nope", uri)
    assert isinstance(info.value, RecomputeError)
    assert uri in str(info.value)


def test_deleted_experiment(uri: str, tmp_path: Path) -> None:
    good_experiment(uri, tmp_path)
    client = MlflowClient(tracking_uri=uri)
    client.delete_experiment(client.get_experiment_by_name("exp").experiment_id)
    with pytest.raises(PolicyError, match="'exp' is deleted"):
        load_good_policy("exp", uri)


def test_experiment_without_a_good_policy_names_the_tag(uri: str, tmp_path: Path) -> None:
    good_experiment(uri, tmp_path, tag=False)
    with pytest.raises(PolicyError, match=r"'exp' has no good policy yet \(tag recompute.good_run_id is not set\)"):
        load_good_policy("exp", uri)


def test_good_run_that_does_not_exist_names_the_run(uri: str, tmp_path: Path) -> None:
    good_experiment(uri, tmp_path)
    client = MlflowClient(tracking_uri=uri)
    exp_id = client.get_experiment_by_name("exp").experiment_id
    client.set_experiment_tag(exp_id, GOOD_RUN_TAG, "0" * 32)
    with pytest.raises(PolicyError, match=f"names run {'0' * 32}, which does not exist"):
        load_good_policy("exp", uri)


def test_deleted_good_run(uri: str, tmp_path: Path) -> None:
    run_id = good_experiment(uri, tmp_path)
    MlflowClient(tracking_uri=uri).delete_run(run_id)
    with pytest.raises(PolicyError, match=f"names run {run_id}, which is deleted"):
        load_good_policy("exp", uri)


def test_good_run_without_the_policy_artifact(uri: str, tmp_path: Path) -> None:
    run_id = good_experiment(uri, tmp_path, policy_text=None)
    with pytest.raises(PolicyError, match=f"good run {run_id} has no artifact 'policy.yaml'"):
        load_good_policy("exp", uri)


def test_invalid_policy_artifact_names_run_and_problem(uri: str, tmp_path: Path) -> None:
    run_id = good_experiment(uri, tmp_path, policy_text="version: 1\nlayers: {blocks.0: sometimes}\n")
    with pytest.raises(
        PolicyError, match=f"good run {run_id}: artifact 'policy.yaml' is not a valid policy.*sometimes"
    ):
        load_good_policy("exp", uri)


def test_hostile_policy_artifact_is_a_policy_error(uri: str, tmp_path: Path) -> None:
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [{', '.join(['*a' + ('' if i == 1 else str(i - 1))] * 9)}]\n" for i in range(1, 9)
    )
    run_id = good_experiment(uri, tmp_path, policy_text=bomb)
    with pytest.raises(
        PolicyError, match=f"good run {run_id}: artifact 'policy.yaml' is not a valid policy: .*aliases"
    ):
        load_good_policy("exp", uri)


def test_tampered_artifact_names_run_and_both_fingerprints(uri: str, tmp_path: Path) -> None:
    other = RecomputePolicy.uniform("full")
    run_id = good_experiment(uri, tmp_path, policy_text=other.to_yaml())
    with pytest.raises(PolicyError) as info:
        load_good_policy("exp", uri)
    message = str(info.value)
    assert f"good run {run_id}: artifact 'policy.yaml' has fingerprint {other.fingerprint()}" in message
    assert f"the run recorded {POLICY.fingerprint()} (tag {FINGERPRINT_TAG})" in message


def test_run_without_a_fingerprint_tag_loads_unchecked(uri: str, tmp_path: Path) -> None:
    good_experiment(uri, tmp_path, fingerprint=None)
    assert load_good_policy("exp", uri) == POLICY


@pytest.mark.parametrize("form", ["absolute", "relative", "environment"])
def test_mistyped_sqlite_uri_creates_no_database(
    uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    good_experiment(uri, tmp_path)
    monkeypatch.chdir(tmp_path)
    typo = tmp_path / "mlflwo.db"
    mistyped = "sqlite:///mlflwo.db" if form == "relative" else f"sqlite:///{typo}"
    if form == "environment":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", mistyped)
    with pytest.raises(PolicyError) as info:
        load_good_policy("exp", None if form == "environment" else mistyped)
    assert f"mlflow:exp (tracking URI {mistyped}): " in str(info.value)
    assert "does not exist" in str(info.value) and "mlflwo.db" in str(info.value)
    assert not typo.exists()
    with pytest.raises(PolicyError, match="does not exist"):
        good_run_id("exp", mistyped)
    assert not typo.exists()


def test_missing_file_store_folder_is_not_created(tmp_path: Path) -> None:
    store = tmp_path / "mlruns-typo"
    with pytest.raises(PolicyError, match=f"{store} does not exist"):
        load_good_policy("exp", store.as_uri())
    assert not store.exists()


def test_download_draws_no_progress_bar_and_leaves_the_environment_alone(
    uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    good_experiment(uri, tmp_path)
    monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)
    capfd.readouterr()
    assert load_good_policy("exp", uri) == POLICY
    assert "Downloading artifacts" not in capfd.readouterr().err
    assert "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR" not in os.environ
    # A user who asks for the bar gets it: the check above can fail.
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "true")
    assert load_good_policy("exp", uri) == POLICY
    assert "Downloading artifacts" in capfd.readouterr().err


@pytest.mark.slow
def test_the_plugin_module_does_not_import_the_tuner() -> None:
    code = (
        "import sys, lightning_recompute.mlflow_policy as m\n"
        "assert not any(k == 'tuner' or k.startswith('tuner.') for k in sys.modules), 'tuner imported'\n"
        "assert 'mlflow' not in sys.modules, 'mlflow imported at module import'\n"
    )
    root = REPO
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_callback_and_apply_take_the_good_policy_from_mlflow(uri: str, tmp_path: Path) -> None:
    from lightning_recompute import RecomputeCallback, applied_policy, apply_policy
    from lightning_recompute.reference import ReferenceGPT

    good_experiment(uri, tmp_path)
    assert RecomputeCallback(f"mlflow:exp@{uri}").policy == POLICY
    model = ReferenceGPT(n_layer=4, n_embd=32, n_head=4)
    apply_policy(model, f"mlflow:exp@{uri}")
    assert applied_policy(model).policy.short(["blocks.0", "blocks.1", "blocks.2", "blocks.3"]) == ".ssF"
    with pytest.raises(PolicyError, match="names no experiment"):
        RecomputeCallback("mlflow:")
