"""Opening the stores the parent writes to: Optuna storage and the MLflow tracking store.

Several workers may open one SQLite file at once; the first creates or migrates its tables, and
two doing that together fail on each other's half-made schema. `sqlite_setup_lock` serialises
the opening; `open_tracker` also retries what the lock cannot cover (no ``fcntl``; a tracking
server still starting).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
from optuna.storages.journal import JournalFileBackend

from lightning_recompute.errors import RecomputeError
from tuner.tracking import Tracker

try:
    import fcntl
except ImportError:  # not POSIX: stores open unlocked; `open_tracker` retries a failed open
    fcntl = None  # type: ignore[assignment]

__all__ = ["open_storage", "open_tracker", "sqlite_setup_lock"]

_log = logging.getLogger(__name__)


@contextlib.contextmanager
def sqlite_setup_lock(url: str) -> Iterator[None]:
    """Hold an exclusive lock beside a ``sqlite:///`` database while a store opens it; a no-op otherwise.

    Opening a new SQLite store creates or migrates its tables (Optuna's and MLflow's both do), and
    two workers doing that at once fail on each other's half-made schema. Once made, opening is
    a plain read, so the lock is only held for the opening.
    """
    if not url.startswith("sqlite:///") or fcntl is None:
        yield
        return
    path = Path(url[len("sqlite:///") :]).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """Optuna storage for a database URL, or a journal file for a path ending in ``.log``.

    SQLite gets a long lock timeout: several workers on one file wait for each other's writes
    instead of failing with "database is locked".
    """
    if "://" not in url:
        if not url.endswith(".log"):
            raise RecomputeError(
                f"study.storage: {url!r} is neither a database URL nor a journal file "
                f"(valid: sqlite:///optuna.db, postgresql://..., or a path ending in .log)"
            )
        path = Path(url).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    if url.startswith("sqlite:///"):
        with sqlite_setup_lock(url):
            return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 120}})
    return optuna.storages.RDBStorage(url)


def open_tracker(tracking_uri: str, experiment: str, attempts: int = 5) -> Tracker:
    """The `Tracker` of ``experiment``, opened under the SQLite setup lock, retried on failure.

    Two workers starting at once against a new SQLite tracking database would both run MLflow's
    schema migration and fail on each other's half-made tables; the lock serialises that. The
    retry covers stores the lock cannot (no ``fcntl``; a server still starting).
    """
    from alembic.util.exc import CommandError
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    for attempt in range(1, attempts + 1):
        try:
            with sqlite_setup_lock(tracking_uri):
                return Tracker(tracking_uri, experiment)
        except (CommandError, MlflowException, SQLAlchemyError) as err:
            if attempt == attempts:
                raise
            _log.info("opening the MLflow store failed (%s); retrying", err)
            time.sleep(0.5 * attempt)
    raise AssertionError("unreachable")  # the loop returns or raises
