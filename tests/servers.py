"""Throwaway PostgreSQL clusters and MLflow tracking servers on 127.0.0.1, for tests and benchmarks.

A `PostgresCluster` is ``initdb`` in a temp dir, listening on 127.0.0.1 on a free port with its
unix socket in the same dir, trust authentication, and fsync off (it holds nothing worth keeping).
``initdb`` and ``pg_ctl`` refuse to run as root, so under root they run as the ``postgres`` user
that the OS package creates, and the temp dir is handed to that user. An `MlflowServer` is
``mlflow server`` with a database of such a cluster as its backend store and a temp dir as its
artifact destination. Both are plain classes (no pytest here): ``tests/conftest.py`` wraps them in
fixtures and ``bench/cluster_overhead.py`` starts them itself.

Every wait has a deadline: ``pg_ctl`` gets ``-t`` and every subprocess a timeout, and the MLflow
server's ``/health`` is polled until a deadline, after which the server's log tail is raised.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

PG_USER = "postgres"
"""The OS user that runs the server under root, and the database superuser."""

_START_TIMEOUT_S = 60
_COMMAND_TIMEOUT_S = 120


class ServerUnavailable(RuntimeError):
    """The server cannot be started here (binaries or user missing); the message says what is missing."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def postgres_bin_dir() -> Path:
    """The folder holding ``initdb`` and ``pg_ctl``: the newest /usr/lib/postgresql/*/bin, else ``PATH``.

    Raises:
        ServerUnavailable: neither has both programs.
    """
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name), reverse=True)
    which = shutil.which("initdb")
    if which:
        candidates.append(str(Path(which).resolve().parent))
    for folder in candidates:
        if all((Path(folder) / name).is_file() for name in ("initdb", "pg_ctl", "createdb")):
            return Path(folder)
    raise ServerUnavailable(
        "PostgreSQL binaries (initdb, pg_ctl, createdb) not found under /usr/lib/postgresql/*/bin or on PATH; "
        "install the OS package (apt-get install postgresql), as .ci/run does"
    )


class PostgresCluster:
    """A throwaway PostgreSQL cluster in its own temp dir; `start`, `stop`, `restart`, `create_database`.

    Args:
        port: the TCP port on 127.0.0.1 (default: a free one). It stays the same across
            `stop` / `start`, so URLs handed out before a stop work again after the restart.
    """

    def __init__(self, port: int | None = None) -> None:
        self.bin = postgres_bin_dir()
        self._as_root = os.geteuid() == 0
        if self._as_root:
            try:
                user = pwd.getpwnam(PG_USER)
            except KeyError:
                raise ServerUnavailable(
                    f"running as root, and initdb/pg_ctl refuse root, but there is no {PG_USER!r} user "
                    "to run them as (the OS postgresql package creates it)"
                ) from None
            if not shutil.which("runuser"):
                raise ServerUnavailable("running as root and 'runuser' is missing: cannot run initdb as postgres")
        # Not under pytest's tmp_path: that lives in a 0700 root folder the postgres user cannot enter.
        self.root = Path(tempfile.mkdtemp(prefix="recompute-pg-"))
        if self._as_root:
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = port or free_port()
        self.running = False
        self._initialised = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Create the cluster on first use, then start the server; returns once it accepts connections."""
        if not self._initialised:
            self._run(
                "initdb",
                "-D",
                str(self.data),
                "-U",
                PG_USER,
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            )
            self._initialised = True
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run(
            "pg_ctl",
            "start",
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-w",
            "-t",
            str(_START_TIMEOUT_S),
            "-o",
            options,
        )
        self.running = True

    def stop(self) -> None:
        """Stop the server at once (``-m immediate``: connections are cut, as when a database host dies)."""
        if self.running:
            self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w", "-t", str(_START_TIMEOUT_S))
            self.running = False

    def restart(self) -> None:
        """`stop` then `start`, on the same port."""
        self.stop()
        self.start()

    def destroy(self) -> None:
        """Stop the server (if running) and delete the cluster's files."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PostgresCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    # ------------------------------------------------------------------ databases

    def create_database(self, name: str) -> str:
        """Create database ``name``; its SQLAlchemy URL (``postgresql://``: psycopg 3 under SQLAlchemy 2.1)."""
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", PG_USER, name)
        return self.url(name)

    def url(self, database: str) -> str:
        """The SQLAlchemy URL of ``database`` in this cluster."""
        return f"postgresql://{PG_USER}@127.0.0.1:{self.port}/{database}"

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log (for error messages)."""
        try:
            return self.log.read_text(encoding="utf-8", errors="replace")[-chars:]
        except OSError:
            return ""

    def _run(self, program: str, *args: str) -> None:
        cmd = [str(self.bin / program), *args]
        if self._as_root:
            cmd = ["runuser", "-u", PG_USER, "--", *cmd]
        proc = subprocess.run(
            cmd, check=False, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, cwd=self.root
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{program} {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
                f"\nserver log:\n{self.log_tail()}"
            )


class MlflowServer:
    """``mlflow server`` on 127.0.0.1 with a given backend store and a temp dir for artifacts.

    Args:
        backend_store_uri: the database of runs and experiments (a `PostgresCluster` database).
        python: the interpreter whose ``mlflow`` runs the server (default: this one).
        health_timeout_s: how long to wait for ``/health`` (the first start migrates the schema).
        workers: uvicorn worker processes (MLflow's default is 4; one is enough for a test).
    """

    def __init__(
        self,
        backend_store_uri: str,
        *,
        python: str = sys.executable,
        health_timeout_s: float = 180,
        workers: int = 1,
    ) -> None:
        self.backend_store_uri = backend_store_uri
        self.workers = workers
        self.python = python
        self.health_timeout_s = health_timeout_s
        self.root = Path(tempfile.mkdtemp(prefix="recompute-mlflow-"))
        self.artifacts = self.root / "artifacts"
        self.log = self.root / "server.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server and wait until ``/health`` answers, or raise with the log tail at the deadline."""
        cmd = [
            self.python,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            self.backend_store_uri,
            "--artifacts-destination",
            str(self.artifacts),
            "--serve-artifacts",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            str(self.workers),
        ]
        with self.log.open("wb") as log:
            # Its own session: `stop` signals the whole group (the CLI forks uvicorn / gunicorn workers).
            self._proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.root
            )
        deadline = time.monotonic() + self.health_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited {self._proc.returncode}:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"mlflow server: no /health answer within {self.health_timeout_s:.0f} s:\n{self.log_tail()}")

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 now."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after a deadline."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)

    def destroy(self) -> None:
        """`stop`, then delete the artifacts and the log."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log (for error messages)."""
        try:
            return self.log.read_text(encoding="utf-8", errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> MlflowServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()
