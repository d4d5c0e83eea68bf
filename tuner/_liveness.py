"""Whether the process that owns a trial, a study's setup or a session run is still alive.

A process records itself as an `Owner` on what it holds, and a `Heartbeat` refreshes a timestamp there.
`dead_reason` decides: on the same host (name and boot id) the owner is dead once its pid is gone or
recycled; on another host, once its heartbeat is older than the grace period (`grace_s`).
"""

from __future__ import annotations

import contextlib
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

__all__ = [
    "ENV",
    "GRACE_S",
    "HEARTBEAT_S",
    "POINTS",
    "Heartbeat",
    "Owner",
    "dead_reason",
    "grace_s",
    "heartbeat_s",
    "kill_point",
]

_log = logging.getLogger(__name__)

HEARTBEAT_S = 10.0
"""Seconds between two heartbeats of a live owner."""
GRACE_S = 60.0
"""Seconds without a heartbeat after which an owner on another host counts as dead (six missed beats)."""


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}: {raw!r} is not a number of seconds (valid: a positive number)") from None
    if not value > 0:
        raise ValueError(f"{name}: {raw!r} must be a positive number of seconds")
    return value


def heartbeat_s() -> float:
    """The heartbeat interval: ``RECOMPUTE_TUNE_HEARTBEAT_S`` or `HEARTBEAT_S`."""
    return _env_seconds("RECOMPUTE_TUNE_HEARTBEAT_S", HEARTBEAT_S)


def grace_s() -> float:
    """The grace period for owners on other hosts: ``RECOMPUTE_TUNE_GRACE_S`` or `GRACE_S`."""
    return _env_seconds("RECOMPUTE_TUNE_GRACE_S", GRACE_S)


def process_start(pid: int) -> str | None:
    """An identity of the process ``pid``'s start (Linux: its start time in clock ticks; it tells a
    recycled pid); ``None`` if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its closing one.
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None  # field 22 of the whole line: starttime


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
        if state[state.rfind(")") + 2 :].startswith("Z"):
            return False
    return True


def boot_id() -> str | None:
    """This machine's boot id (Linux), which tells two machines of the same host name apart."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


@dataclass(frozen=True)
class Owner:
    """A process holding something: its host (name and boot id), pid and start identity."""

    host: str
    pid: int
    started: str | None = None
    boot: str | None = None

    @classmethod
    def me(cls) -> Owner:
        """This process."""
        return cls(socket.gethostname(), os.getpid(), process_start(os.getpid()), boot_id())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Owner | None:
        """The owner recorded as `to_dict` wrote it; ``None`` for anything else (an older record)."""
        if not isinstance(data, Mapping) or not isinstance(data.get("pid"), int) or not data.get("host"):
            return None
        started, boot = data.get("started"), data.get("boot")
        return cls(
            str(data["host"]),
            int(data["pid"]),
            None if started is None else str(started),
            None if boot is None else str(boot),
        )

    @property
    def here(self) -> bool:
        """Whether the owner runs on this host (a recorded boot id must match too)."""
        return self.host == socket.gethostname() and (self.boot is None or self.boot == boot_id())

    def gone_here(self) -> str | None:
        """Why this same-host owner is dead, or ``None`` while it lives (or is on another host)."""
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
    """Why the holder of something is dead, or ``None`` while it may be alive.

    Args:
        owner: the recorded owner (``None``: not recorded).
        heartbeat_at: the owner's last heartbeat (``time.time()``), ``None`` if it never beat.
        grace: seconds of silence after which an owner elsewhere (or unrecorded) counts as dead.
        since: when the thing was taken, the silence's start without a heartbeat.
    """
    if owner is not None:
        gone = owner.gone_here()
        if gone is not None:
            return f"owner died: {gone}"
        if owner.here:
            return None  # alive on this host: the pid is the proof, however late its heartbeat
    last = heartbeat_at if heartbeat_at is not None else since
    if last is None:
        return None
    silent = time.time() - last
    if silent > grace:
        who = owner.describe() if owner is not None else "an unrecorded owner"
        return f"owner died: no heartbeat from {who} for {silent:.0f} s (grace period {grace:g} s)"
    return None


class Heartbeat:
    """A daemon thread calling ``beat`` every ``interval`` seconds until `stop` (or the context ends).

    A failing beat is logged, never raised: a store hiccup must not end a trial.
    """

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

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -------------------------------------------------------------------------------- killpoints
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
