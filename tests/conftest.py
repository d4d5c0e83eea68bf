"""Fixtures shared by the plugin and tuner tests, and the fast tier's guard against unmarked subprocesses."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_recompute import QUIET_TRAINER
from tests.servers import MlflowServer, PostgresCluster, ServerUnavailable

# One intra-op thread: the test models are tiny (a second thread buys nothing), and two threads per
# process oversubscribe two cores as soon as anything else runs (a trial, a second pytest worker),
# which made steps 10x slower. Child processes set their own (a recipe's trial.env).
torch.set_num_threads(1)


SLOW_TIMEOUT_S = 900
"""The per-test limit of a ``slow`` test without its own ``@pytest.mark.timeout``. The fast tier's 240 s
(pyproject) catches a hang in seconds-long tests; a slow test runs whole tuning sessions of 100-150 s on an
idle 2-core machine and twice that when the machine is busy, and the limit is there for hangs, not for load."""


def pytest_addoption(parser: pytest.Parser) -> None:
    # Here, not in tests/gpu/conftest.py: pytest reads options only from the conftest files it loads first.
    parser.addoption("--gpu-json", metavar="PATH", help="write the GPU acceptance checks' figures (tests/gpu) to PATH")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


@pytest.fixture(autouse=True)
def _unmarked_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails a test not marked ``slow`` that starts a process (an interpreter, a server, a launch of ranks).

    The fast tier (``-m 'not slow'``, the default) promises to start none: a process costs seconds
    to import torch and Lightning, and a new test that starts one without saying so is how a
    three-minute suite became a forty-minute one. This makes the marker a checked fact.
    """
    if request.node.get_closest_marker("slow") is not None:
        return

    def refuse(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        program = args if isinstance(args, (str, bytes, os.PathLike)) else next(iter(args), "")
        pytest.fail(
            f"{request.node.nodeid} starts a process ({os.fsdecode(program)!r}) but is not marked slow: "
            "mark it @pytest.mark.slow (the fast tier starts no process)",
            pytrace=False,
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


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


@pytest.fixture
def quiet_trainer(tmp_path: Path) -> Callable[..., L.Trainer]:
    """Makes a ``Trainer`` on one CPU device that writes nothing (no logger, checkpoints, progress bar or
    summary; `QUIET_TRAINER`) and keeps its folder in the test's own; keywords add or override."""

    def make(**kwargs: Any) -> L.Trainer:
        return L.Trainer(
            **{"accelerator": "cpu", "devices": 1, "default_root_dir": tmp_path, **QUIET_TRAINER, **kwargs}
        )

    return make


# ---------------------------------------------------------------------------------------------- real servers


def _cluster_or_skip() -> PostgresCluster:
    try:
        return PostgresCluster()
    except ServerUnavailable as exc:
        pytest.skip(f"no PostgreSQL server for the cluster tests: {exc}")


@contextlib.contextmanager
def _started_cluster() -> Iterator[PostgresCluster]:
    """A PostgreSQL cluster, started; destroyed on exit (skips where PostgreSQL is missing)."""
    cluster = _cluster_or_skip()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresCluster]:
    """A throwaway PostgreSQL cluster on 127.0.0.1 shared by the session (skips where PostgreSQL is missing)."""
    with _started_cluster() as cluster:
        yield cluster


@pytest.fixture
def postgres_url(postgres: PostgresCluster) -> str:
    """A fresh, empty database of the shared cluster: its ``postgresql://`` URL."""
    return postgres.create_database(f"t_{uuid.uuid4().hex[:12]}")


@pytest.fixture
def own_postgres() -> Iterator[PostgresCluster]:
    """A PostgreSQL cluster of the test's own, started, that the test may `stop` and `start` again."""
    with _started_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def mlflow_server(postgres: PostgresCluster) -> Iterator[str]:
    """``mlflow server`` backed by a database of the shared cluster: its ``http://127.0.0.1:PORT`` URL."""
    server = MlflowServer(postgres.create_database("mlflow"))
    try:
        server.start()
        yield server.url
    finally:
        server.destroy()
