"""Fixtures shared by the plugin and tuner tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def empty_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLflow database with its schema created once: migrations take seconds, copies take none."""
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def uri(tmp_path: Path, empty_db: Path) -> str:
    """A fresh sqlite MLflow tracking URI of the test's own."""
    shutil.copy(empty_db, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"
