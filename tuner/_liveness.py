"""Whether the `Owner` of a trial, a study's setup, a gate lease or a session run is alive: on its host, while
its pid lives; elsewhere, while its `Heartbeat` is younger than the grace period. Not Optuna's heartbeat: that
covers only trials, only in RDB storages, and cannot see a process on the same host die at once."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_log = logging.getLogger(__name__)

HEARTBEAT_S = 10.0
GRACE_S = 60.0  # without a heartbeat, an owner on another host is dead (six missed beats)


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name) or str(default)
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}: {raw!r} is not a number of seconds (valid: a positive number)") from None
    if not value > 0:
        raise ValueError(f"{name}: {raw!r} must be a positive number of seconds")
    return value


def heartbeat_s() -> float:
    return _env_seconds("RECOMPUTE_TUNE_HEARTBEAT_S", HEARTBEAT_S)


def grace_s() -> float:
    return _env_seconds("RECOMPUTE_TUNE_GRACE_S", GRACE_S)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _stat(pid: int) -> list[str]:
    """Fields 3 on of ``/proc/<pid>/stat`` (after the command name, which may hold spaces and parentheses)."""
    stat = _read(f"/proc/{pid}/stat") or ""
    return stat[stat.rfind(")") + 2 :].split()


def process_start(pid: int) -> str | None:
    """Its start in clock ticks, which tells a recycled pid."""
    fields = _stat(pid)
    return fields[19] if len(fields) > 19 else None  # field 22 of the whole line: starttime


def boot_id() -> str | None:
    return _read("/proc/sys/kernel/random/boot_id") or None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return _stat(pid)[:1] != ["Z"]


@dataclass(frozen=True)
class Owner:
    """A process holding something: its host (name and boot id: two machines may share a name), pid and start."""

    host: str
    pid: int
    started: str | None = None
    boot: str | None = None

    @classmethod
    def me(cls) -> Owner:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, process_start(pid), boot_id())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Owner | None:
        if not isinstance(data, Mapping) or not isinstance(data.get("pid"), int) or not data.get("host"):
            return None
        started, boot = data.get("started"), data.get("boot")
        return cls(str(data["host"]), data["pid"], *(None if v is None else str(v) for v in (started, boot)))

    @property
    def here(self) -> bool:
        return self.host == socket.gethostname() and self.boot in (None, boot_id())

    def gone_here(self) -> str | None:
        """Why this same-host owner is dead; ``None`` while it lives or is on another host."""
        if not self.here:
            return None
        if not pid_alive(self.pid):
            return f"its process {self.pid} on {self.host} is gone"
        now = process_start(self.pid)
        if self.started is not None and now is not None and now != self.started:
            return f"its process {self.pid} on {self.host} is gone (the pid now belongs to another process)"
        return None

    def describe(self) -> str:
        return f"{self.host}:{self.pid}"


def dead_reason(
    owner: Owner | None, heartbeat_at: float | None, *, grace: float, since: float | None = None
) -> str | None:
    """Why the holder of something is dead; ``since``: when it took it, the silence's start without a beat."""
    if owner is not None:
        gone = owner.gone_here()
        if gone is not None:
            return f"owner died: {gone}"
        if owner.here:
            return None  # alive on this host: the pid is the proof, however late its heartbeat
    last = heartbeat_at if heartbeat_at is not None else since
    silent = 0.0 if last is None else time.time() - last
    if silent <= grace:
        return None
    who = owner.describe() if owner is not None else "an unrecorded owner"
    return f"owner died: no heartbeat from {who} for {silent:.0f} s (grace period {grace:g} s)"


class Heartbeat:
    """A daemon thread calling ``beat`` every ``interval`` seconds; a failing beat is logged, never raised: a store
    hiccup must not end a trial."""

    def __init__(self, beat: Callable[[], None], interval: float | None = None) -> None:
        self._beat = beat
        self._interval = heartbeat_s() if interval is None else interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recompute-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._interval + 30.0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._beat()
            except Exception as err:  # noqa: BLE001 - see the class docstring
                _log.info("heartbeat failed (%s); retrying in %g s", err, self._interval)


# A test hook: ``RECOMPUTE_TUNE_TEST_KILL_AT=<point>`` makes `recompute-tune` SIGKILL itself at that point.
ENV = "RECOMPUTE_TUNE_TEST_KILL_AT"
POINTS = ("profiling", "trial", "between", "gate", "after_write", "rollback")


def kill_point(point: str) -> None:
    """SIGKILL this process (its process group when it leads one) if ``ENV`` names ``point``."""
    if not point or os.environ.get(ENV) != point:
        return
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
