"""Checking a recipe's settings (output path, tracking URI, study storage) before anything is measured, all at once."""

from __future__ import annotations

import errno
import os
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from lightning_recompute.errors import RecomputeError, clip
from tuner._stores import storage_problem

if TYPE_CHECKING:
    from tuner.recipe import Recipe

CONNECT_TIMEOUT_S = 10.0  # how long a tracking server has to accept a connection
_KERNEL_FILESYSTEMS = (Path("/proc"), Path("/sys"), Path("/dev"))  # interfaces, not storage

TRACKING_FORMS = (
    "sqlite:///path/mlflow.db, postgresql://user@host/db, mysql://..., http(s)://host:port, "
    "file:///path/mlruns or databricks"
)


class SettingsError(RecomputeError, ValueError):
    """A recipe's settings cannot work; `problems` holds each, ``key: problem (valid: ...)``."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        noun = "problem" if len(self.problems) == 1 else "problems"
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} {noun} in the recipe's settings:\n{lines}")


def check_settings(recipe: Recipe, *, output: bool = True) -> None:
    """Raise a `SettingsError` of every problem found."""
    found = (
        output_problem(recipe.output) if output else None,
        tracking_problem(recipe.tracking.uri),
        storage_problem(str(recipe.study.storage)),
        nodes_problem(recipe),
    )
    if problems := [p for p in found if p is not None]:
        raise SettingsError(problems)


def nodes_problem(recipe: Recipe) -> str | None:
    """Why the recipe's trials, spanning several nodes, cannot run here; ``None`` when they run on one."""
    if recipe.trainer.num_nodes == 1:
        return None
    return (
        f"trainer.num_nodes: {recipe.trainer.num_nodes}, but a trial runs its ranks on this one node (Lightning's "
        f"launcher starts only local ranks; the other nodes' would wait for a job nobody starts) (valid for tuning: "
        f"1, with trainer.devices up to this node's devices; `recompute-tune plan` takes any num_nodes)"
    )


def output_problem(path: Path, key: str = "output") -> str | None:
    """Why the policy file cannot be written at ``path``: a file is made in the nearest existing folder (permission
    bits say nothing of read-only mounts)."""
    shown = clip(str(path))
    if any(path == root or root in path.parents for root in _KERNEL_FILESYSTEMS):
        return f"{key}: {shown} is on a kernel filesystem, not storage (valid: a file path in a writable folder)"
    if path.is_dir():
        return f"{key}: {shown} is a directory (valid: a file path, e.g. {clip(str(path / 'policy.yaml'))})"
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{key}: {clip(str(folder))} is a file, so {shown} cannot be created under it"
    try:
        tempfile.TemporaryFile(prefix=".recompute-write-test.", dir=folder).close()
    except OSError as err:
        why = err.strerror or str(err)
        return f"{key}: cannot create a file in {clip(str(folder))} ({why}), so {shown} cannot be written"
    return None


def tracking_problem(uri: str) -> str | None:
    """Why MLflow cannot track to ``uri``, or ``None``; a server must accept a connection within `CONNECT_TIMEOUT_S`."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry  # the schemes MLflow registers

    shown = clip(repr(uri))
    scheme = urlsplit(uri).scheme if "://" in uri or ":" in uri else ""
    if not scheme or (len(scheme) == 1 and os.name == "nt"):
        return f"tracking.uri: {shown} is not a URI (valid: {TRACKING_FORMS})"
    base = scheme.split("+", 1)[0]  # postgresql+psycopg: the dialect names the store
    known = set(_tracking_store_registry._registry)
    if base not in known:
        return f"tracking.uri: {shown} has an unknown scheme {scheme!r} (valid: {TRACKING_FORMS})"
    if base not in ("http", "https"):
        return None
    # MLflow's own client retries a refused connection for minutes.
    parts = urlsplit(uri)
    try:
        host, port = parts.hostname, parts.port or (443 if base == "https" else 80)
    except ValueError:
        return f"tracking.uri: {shown} has an invalid port (valid: {TRACKING_FORMS})"
    if not host:
        return f"tracking.uri: {shown} names no host (valid: {TRACKING_FORMS})"
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return None
    except OSError as err:
        why = (
            "timed out"
            if isinstance(err, TimeoutError)
            else (err.strerror or errno.errorcode.get(err.errno or 0, str(err)))
        )
        return (
            f"tracking.uri: cannot reach the tracking server at {host}:{port} ({why}); start it "
            f"(mlflow server --host {host} --port {port}) or correct the URI"
        )
