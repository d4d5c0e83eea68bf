"""Fixtures of the session tests (`test_session.py`) and the dead-owner tests (`test_liveness.py`)."""

from __future__ import annotations

import pytest

from tests.tuner.fakes import ExactTrials


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    # One MLflow database per module (creating one costs seconds); one experiment per test.
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> ExactTrials:
    """The session's trial runner, race and numerics check replaced by `ExactTrials`' exact figures."""
    f = ExactTrials()
    monkeypatch.setattr("tuner._trials.run_trial", f.run_trial)
    monkeypatch.setattr("tuner._trials.check_numerics", f.check_numerics)
    monkeypatch.setattr("tuner._trials.run_race", f.run_race)
    return f
