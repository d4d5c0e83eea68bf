"""Atomic file replacement: a reader sees the old content or the new, never half of either."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def atomic_write(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file and ``os.replace``, keeping the permissions of the file
    it replaces (``0666 & ~umask`` when new, not ``mkstemp``'s 0600)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(p.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p
