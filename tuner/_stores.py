"""Opening the stores (Optuna storage, the MLflow tracking store) and explaining their failures."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import optuna
from optuna.storages.journal import JournalFileBackend

from lightning_recompute.errors import RecomputeError, clip
from tuner.exits import StoreFailure

if TYPE_CHECKING:
    from tuner.recipe import Recipe

try:
    import fcntl
except ImportError:  # not POSIX: stores open unlocked; `open_tracker` retries a failed open
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "StorageUnavailable",
    "StoreFailure",
    "bound_tracking_requests",
    "driver_missing",
    "hide_password",
    "open_storage",
    "sqlite_setup_lock",
    "storage_failure",
    "store_failure",
]

TRACKING_REQUEST_DEFAULTS = {
    # MLflow retries a failed HTTP request 7 times with exponential backoff, each with a 120 s
    # timeout: an unreachable server held a session for 20 minutes. These bound the tuner's calls.
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
    # MLflow prints "View run ... at: http://..." on stdout when a run ends, which would corrupt
    # `--format json`; the tuner prints its own `mlflow ui` line.
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}
"""What the tuner's process sets for MLflow's HTTP client, each only where the user has not set it."""


@contextlib.contextmanager
def sqlite_setup_lock(url: str) -> Iterator[None]:
    """Hold an exclusive lock beside a ``sqlite:///`` database while a store opens it; a no-op otherwise.

    Opening creates or migrates the tables, and two workers doing that at once fail on each other's
    half-made schema.
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


def bound_tracking_requests() -> None:
    """Set `TRACKING_REQUEST_DEFAULTS` in this process's environment (MLflow reads them at every request)."""
    for name, value in TRACKING_REQUEST_DEFAULTS.items():
        os.environ.setdefault(name, value)


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """Optuna storage for a database URL, or a journal file for a path ending in ``.log``."""
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
            # A long lock timeout: workers on one file wait for each other's writes.
            return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 120}})
    try:
        return _open_server_storage(url)
    except ImportError as err:  # Optuna imports the database's driver when it opens the storage
        raise RecomputeError(driver_missing("study.storage", url, err)) from None


SCHEMA_RACE_ATTEMPTS = 5
"""How many times a worker opens a server database whose schema another worker is creating."""


def _open_server_storage(url: str) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage on a database server, tolerating workers that create its schema at once.

    Optuna's ``create_all`` checks, then creates: of two workers on an empty database the second fails
    with a unique violation, and its retry finds the schema complete.
    """
    from sqlalchemy.exc import IntegrityError, ProgrammingError

    for attempt in range(1, SCHEMA_RACE_ATTEMPTS):
        try:
            return optuna.storages.RDBStorage(url)
        except (IntegrityError, ProgrammingError):
            time.sleep(0.2 * attempt + random.random() * 0.3)  # jitter: the racers must not collide again
    return optuna.storages.RDBStorage(url)


class StorageUnavailable(StoreFailure):
    """The study's database failed while a session was using it (a server stopped, a network cut)."""


def storage_failure(url: str, err: BaseException) -> StorageUnavailable | None:
    """The clear error for ``err`` when it is the study database failing (Optuna's and SQLAlchemy's
    errors name neither the setting nor what to do), else ``None``."""
    from optuna.exceptions import StorageInternalError
    from sqlalchemy.exc import InterfaceError, OperationalError

    if not isinstance(err, (StorageInternalError, OperationalError, InterfaceError)):
        return None
    cause = err.__cause__ or err.__context__ or err
    lines = str(getattr(cause, "orig", None) or cause).strip().splitlines() or [type(cause).__name__]
    return StorageUnavailable(
        f"study.storage: the study database {clip(hide_password(url))} failed: {clip(lines[0])}. "
        "Nothing was promoted and the policy file is unchanged; once the database is reachable, run the "
        "same command again and the study resumes",
        "study.storage",
    )


_DAMAGED = ("file is not a database", "malformed", "no such table", "corrupt", "unexpected end", "expecting value")
"""Words in a store's error that mean its file is damaged, not unreachable."""
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)
"""Errors writing a file that its filesystem, not the tuner, caused."""


def store_failure(recipe: Recipe, err: BaseException) -> StoreFailure | None:
    """The clear error for ``err`` when a store of ``recipe`` failed; ``None`` when it is something else.

    The store is told by where the error arose (MLflow's code or Optuna's) or by the file it names; the
    message names the recipe key, the store, the first line of the cause, and what to do.
    """
    if isinstance(err, StoreFailure):
        return err
    cause = _first_line(err)
    damaged = any(word in cause.lower() for word in _DAMAGED)
    stores = {"study.storage": str(recipe.study.storage), "tracking.uri": recipe.tracking.uri}
    if isinstance(err, OSError) and err.errno in _DISK_ERRNOS and err.filename is not None:
        key = _key_of_file(recipe, Path(os.fsdecode(err.filename)))
        if key is None and err.errno not in (errno.ENOSPC, errno.EDQUOT):
            return None  # a file of nobody's store (the user's own code): not ours to explain
        store = f", a file of the store {clip(hide_password(stores[key]))}" if key in stores else ""
        return StoreFailure(
            f"{key or 'disk'}: cannot write {clip(str(err.filename))}{store} ({err.strerror or err}). Nothing was "
            f"promoted and the policy file is unchanged; free space or make the folder writable, then run the same "
            f"command again (the study resumes from what it holds)",
            key or "disk",
        )
    if _raised_in(err, ("optuna", "storages", "journal")):
        # A journal whose last record was cut short (a full disk, a killed writer) loads, then fails
        # on the next write with whatever Optuna's replay trips over (AttributeError, AssertionError).
        return StoreFailure(
            f"study.storage: the Optuna journal {clip(stores['study.storage'])} is damaged ({clip(cause)}); its last "
            f"record was probably cut short (a full disk, a killed writer). Nothing was promoted and the policy "
            f"file is unchanged; keep a copy, remove the incomplete last line, and run again: the trials before it "
            f"are kept",
            "study.storage",
        )
    if not _is_store_error(err):
        return None
    key = _key_of_code(err)
    if key is None:
        return None
    what = "study storage" if key == "study.storage" else "MLflow tracking store"
    if damaged:
        todo = (
            "its file is damaged: restore it from a backup, or move it aside and run again to start afresh "
            "(keep the old file: SQLite's `sqlite3 FILE .recover` can often salvage one)"
        )
    elif key == "tracking.uri" and recipe.tracking.uri.startswith(("http://", "https://")):
        todo = "check that tracking.uri is an MLflow tracking server (`mlflow server`) and reachable, then run again"
    else:
        todo = "once it is reachable and writable, run the same command again (the study resumes from what it holds)"
    return StoreFailure(
        f"{key}: the {what} {clip(hide_password(stores[key]))} failed: {clip(cause)}. Nothing was promoted and the "
        f"policy file is unchanged; {todo}",
        key,
    )


def _first_line(err: BaseException) -> str:
    cause = getattr(err, "orig", None) or err
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__


def _frames(tb: TracebackType | None) -> Iterator[tuple[str, ...]]:
    """The path parts of each frame's file in traceback ``tb``."""
    while tb is not None:
        yield Path(tb.tb_frame.f_code.co_filename).parts
        tb = tb.tb_next


def _raised_in(err: BaseException, package: tuple[str, ...]) -> bool:
    """Whether a frame of ``err``'s traceback is in ``package`` (path parts, in order)."""
    n = len(package)
    return any(parts[i : i + n] == package for parts in _frames(err.__traceback__) for i in range(len(parts) - n + 1))


def _is_store_error(err: BaseException) -> bool:
    """Whether ``err`` is of a kind a store raises (database, HTTP, journal parsing), not a bug of ours."""
    import json
    import sqlite3

    import requests  # an MLflow dependency
    from mlflow.exceptions import MlflowException
    from optuna.exceptions import StorageInternalError
    from sqlalchemy.exc import SQLAlchemyError

    kinds: tuple[type[BaseException], ...] = (
        MlflowException,
        StorageInternalError,
        SQLAlchemyError,
        sqlite3.Error,
        json.JSONDecodeError,
        UnicodeDecodeError,
        ConnectionError,
        requests.RequestException,
    )
    return isinstance(err, kinds)


def _key_of_code(err: BaseException) -> str | None:
    """``tracking.uri`` when ``err`` arose in MLflow's code, ``study.storage`` in Optuna's; else ``None``."""
    seen: set[int] = set()
    cur: BaseException | None = err
    found = set()
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        for parts in _frames(cur.__traceback__):
            if "mlflow" in parts:
                found.add("tracking.uri")
            elif "optuna" in parts:
                found.add("study.storage")
        cur = cur.__cause__ or cur.__context__
    return next(iter(found)) if len(found) == 1 else None


def _key_of_file(recipe: Recipe, path: Path) -> str | None:
    """The recipe key whose store or output ``path`` belongs to; ``None`` when it is none of them."""
    here = Path(os.path.realpath(path))
    output = Path(os.path.realpath(recipe.output))
    if here == output or (here.parent == output.parent and here.name.startswith(f".{output.name}.")):
        return "output"
    for key, url in (("study.storage", str(recipe.study.storage)), ("tracking.uri", recipe.tracking.uri)):
        local = url[len("sqlite:///") :] if url.startswith("sqlite:///") else url if "://" not in url else None
        if local:
            db = Path(os.path.realpath(local))
            if here == db or (here.parent == db.parent and here.name.startswith(db.name)):
                return key
            if key == "tracking.uri" and (db.parent / "mlartifacts") in here.parents:
                return key
    return None


def driver_missing(key: str, url: str, err: ImportError) -> str:
    """The message for a database URL whose Python driver is not installed."""
    shown = clip(hide_password(url))
    if url.startswith("postgresql"):
        return f"{key}: {shown} needs psycopg: pip install 'lightning-recompute[postgres]'"
    return f"{key}: {shown} needs a database driver that is not installed ({err})"


def hide_password(url: str) -> str:
    """``url`` with any password replaced by ``***``, for messages."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):  # not a URL SQLAlchemy parses: hide what looks like user:password@
        parts = urlsplit(url)
        if parts.password is None:
            return url
        return url.replace(f":{parts.password}@", ":***@", 1)
