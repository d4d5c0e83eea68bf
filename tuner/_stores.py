"""Opening the stores (Optuna storage, the MLflow tracking store) and explaining their failures."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
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

SCHEMA_RACE_ATTEMPTS = 5
"""How many times a worker opens a server database whose schema another worker is creating."""


def bound_tracking_requests() -> None:
    """Set `TRACKING_REQUEST_DEFAULTS` in this process's environment (MLflow reads them at every request)."""
    for name, value in TRACKING_REQUEST_DEFAULTS.items():
        os.environ.setdefault(name, value)


@contextlib.contextmanager
def sqlite_setup_lock(url: str) -> Iterator[None]:
    """Hold an exclusive lock beside a ``sqlite:///`` database while a store opens it (two workers creating
    or migrating the tables at once fail on each other's half-made schema); a no-op otherwise."""
    if not url.startswith("sqlite:///") or fcntl is None:
        yield
        return
    path = Path(url[len("sqlite:///") :]).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)  # released when the file closes
        yield


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """Optuna storage for a database URL, or a journal file for a path ending in ``.log``."""
    problem = storage_problem(url)
    if problem is not None:
        raise RecomputeError(problem)
    if "://" not in url:
        path = Path(url).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    if url.startswith("sqlite:///"):
        with sqlite_setup_lock(url):
            # A long lock timeout: workers on one file wait for each other's writes.
            return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 120}})
    from sqlalchemy.exc import IntegrityError, ProgrammingError

    # Optuna's ``create_all`` checks, then creates: of two workers on an empty database the second
    # fails with a unique violation, and its retry finds the schema complete.
    for attempt in range(1, SCHEMA_RACE_ATTEMPTS):
        with contextlib.suppress(IntegrityError, ProgrammingError):
            return optuna.storages.RDBStorage(url)
        time.sleep(0.2 * attempt + random.random() * 0.3)  # jitter: the racers must not collide again
    return optuna.storages.RDBStorage(url)


STORAGE_FORMS = "sqlite:///path/optuna.db, postgresql://user@host/db, mysql://user@host/db, or a path ending in .log"


def storage_problem(url: str) -> str | None:
    """Why Optuna cannot store a study at ``url``, or ``None`` (the driver's import is checked, not the server)."""
    if "://" not in url:
        if url.endswith(".log"):
            return None
        return f"study.storage: {clip(repr(url))} is neither a database URL nor a journal file (valid: {STORAGE_FORMS})"
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        dialect = make_url(url).get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError):
        return f"study.storage: {clip(repr(hide_password(url)))} is not a database URL (valid: {STORAGE_FORMS})"
    try:
        dialect.import_dbapi()
    except ImportError as err:
        shown = clip(hide_password(url))
        if url.startswith("postgresql"):
            return f"study.storage: {shown} needs psycopg: pip install 'lightning-recompute[postgres]'"
        return f"study.storage: {shown} needs a database driver that is not installed ({err})"
    return None


_NOTHING_CHANGED = "Nothing was promoted and the policy file is unchanged"


def storage_failure(url: str, err: BaseException) -> StoreFailure | None:
    """The study database failing mid-session (a server stopped, a network cut), named; else ``None``."""
    from optuna.exceptions import StorageInternalError
    from sqlalchemy.exc import InterfaceError, OperationalError

    if not isinstance(err, (StorageInternalError, OperationalError, InterfaceError)):
        return None
    cause = err.__cause__ or err.__context__ or err
    lines = str(getattr(cause, "orig", None) or cause).strip().splitlines() or [type(cause).__name__]
    return StoreFailure(
        f"study.storage: the study database {clip(hide_password(url))} failed: {clip(lines[0])}. {_NOTHING_CHANGED}; "
        "once the database is reachable, run the same command again and the study resumes",
        "study.storage",
    )


_DAMAGED = ("file is not a database", "malformed", "no such table", "corrupt", "unexpected end", "expecting value")
"""Words in a store's error that mean its file is damaged, not unreachable."""
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)
"""Errors writing a file that its filesystem, not the tuner, caused."""
_RESUME = "run the same command again (the study resumes from what it holds)"


def store_failure(recipe: Recipe, err: BaseException) -> StoreFailure | None:
    """The clear error for ``err`` when a store of ``recipe`` failed, told by where it arose (MLflow's code or
    Optuna's) or the file it names; ``None`` when it is something else."""
    if isinstance(err, StoreFailure):
        return err
    stores = {"study.storage": str(recipe.study.storage), "tracking.uri": recipe.tracking.uri}
    if isinstance(err, OSError) and err.errno in _DISK_ERRNOS and err.filename is not None:
        key = _key_of_file(recipe, Path(os.fsdecode(err.filename)))
        if key is None and err.errno not in (errno.ENOSPC, errno.EDQUOT):
            return None  # a file of nobody's store (the user's own code): not ours to explain
        store = f", a file of the store {clip(hide_password(stores[key]))}" if key in stores else ""
        return StoreFailure(
            f"{key or 'disk'}: cannot write {clip(str(err.filename))}{store} ({err.strerror or err}). "
            f"{_NOTHING_CHANGED}; free space or make the folder writable, then {_RESUME}",
            key or "disk",
        )
    cause = getattr(err, "orig", None) or err
    lines = str(cause).strip().splitlines()
    cause_line = clip(f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__)
    frames = _frames(err)
    if any(parts[i : i + 3] == ("optuna", "storages", "journal") for parts in frames for i in range(len(parts))):
        # A journal whose last record was cut short (a full disk, a killed writer) loads, then fails
        # on the next write with whatever Optuna's replay trips over (AttributeError, AssertionError).
        return StoreFailure(
            f"study.storage: the Optuna journal {clip(stores['study.storage'])} is damaged ({cause_line}); its last "
            f"record was probably cut short (a full disk, a killed writer). {_NOTHING_CHANGED}; keep a copy, remove "
            f"the incomplete last line, and run again: the trials before it are kept",
            "study.storage",
        )
    keys = {
        "tracking.uri" if "mlflow" in parts else "study.storage"
        for parts in frames
        if {"mlflow", "optuna"} & set(parts)
    }
    if not _is_store_error(err) or len(keys) != 1:
        return None
    (key,) = keys
    if any(word in cause_line.lower() for word in _DAMAGED):
        todo = (
            "its file is damaged: restore it from a backup, or move it aside and run again to start afresh "
            "(keep the old file: SQLite's `sqlite3 FILE .recover` can often salvage one)"
        )
    elif key == "tracking.uri" and recipe.tracking.uri.startswith(("http://", "https://")):
        todo = "check that tracking.uri is an MLflow tracking server (`mlflow server`) and reachable, then run again"
    else:
        todo = f"once it is reachable and writable, {_RESUME}"
    what = "study storage" if key == "study.storage" else "MLflow tracking store"
    return StoreFailure(
        f"{key}: the {what} {clip(hide_password(stores[key]))} failed: {cause_line}. {_NOTHING_CHANGED}; {todo}", key
    )


def _frames(err: BaseException) -> list[tuple[str, ...]]:
    out, seen = [], set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        out += [Path(frame.f_code.co_filename).parts for frame, _ in traceback.walk_tb(cur.__traceback__)]
        cur = cur.__cause__ or cur.__context__
    return out


def _is_store_error(err: BaseException) -> bool:
    """Whether ``err`` is of a kind a store raises (database, HTTP, journal parsing), not a bug of ours."""
    import json
    import sqlite3

    import requests  # an MLflow dependency
    from mlflow.exceptions import MlflowException
    from optuna.exceptions import StorageInternalError
    from sqlalchemy.exc import SQLAlchemyError

    kinds = (MlflowException, StorageInternalError, SQLAlchemyError, sqlite3.Error, json.JSONDecodeError)
    return isinstance(err, (*kinds, UnicodeDecodeError, ConnectionError, requests.RequestException))


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


def hide_password(url: str) -> str:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):  # not a URL SQLAlchemy parses: hide what looks like user:password@
        password = urlsplit(url).password
        return url if password is None else url.replace(f":{password}@", ":***@", 1)
