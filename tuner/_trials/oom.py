"""Recognising an out-of-memory failure: the child's exception (`is_oom_error`), a dead child's output
(`OOM_MARKERS`), and whether the kernel's out-of-memory killer sent a SIGKILL (`oom_evidence`), which
``kill -9``, schedulers and container runtimes send too.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OOM_MARKERS", "OomEvidence", "is_oom_error", "kernel_log_oom_kill", "oom_evidence", "oom_kill_count"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where the cgroup filesystems are mounted (a module constant so tests can point it at a fake tree)."""
KMSG = Path("/dev/kmsg")
"""The kernel log, one record per read (readable by root, or where ``kernel.dmesg_restrict`` is 0)."""

OOM_MARKERS = ("CUDA out of memory", "DefaultCPUAllocator: can't allocate memory", "OutOfMemoryError")
"""Text that identifies an out-of-memory failure in an error message or a traceback."""


def is_oom_error(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) is an out-of-memory error."""
    import torch

    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, torch.OutOfMemoryError):
            return True
        if isinstance(cur, RuntimeError) and any(m in str(cur) for m in OOM_MARKERS[:2]):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _cgroup_files() -> list[Path]:
    """The files holding this process's cgroup ``oom_kill`` counter, most specific first (v2, then v1).

    Inside a container ``/proc/self/cgroup`` names a path outside its view: the mount's root comes next.
    """
    try:
        lines = Path("/proc/self/cgroup").read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    files = []
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        rel = path.lstrip("/")
        if controllers == "":
            files += [CGROUP_ROOT / rel / "memory.events", CGROUP_ROOT / "memory.events"]
        elif "memory" in controllers.split(","):
            files += [
                CGROUP_ROOT / "memory" / rel / "memory.oom_control",
                CGROUP_ROOT / "memory" / "memory.oom_control",
            ]
    return files


def oom_kill_count() -> int | None:
    """How many processes the out-of-memory killer has killed in this process's cgroup; ``None``: not readable."""
    for path in _cgroup_files():
        try:
            text = path.read_text(encoding="utf-8")
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def kernel_log_oom_kill(pid: int) -> bool | None:
    """Whether the kernel log records the out-of-memory killer killing ``pid``; ``None``: the log is not readable."""
    try:
        fd = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    needles = (f"Killed process {pid} ", f",pid={pid},")  # the kill line, and the oom-kill summary line
    try:
        while True:
            try:
                record = os.read(fd, 8192).decode("utf-8", "replace")
            except OSError as err:
                if err.errno == errno.EPIPE:  # records overwritten while reading: go on with the next
                    continue
                return False  # EAGAIN: the end of the log
            if not record:
                return False
            if "oom" in record.lower() and any(n in record for n in needles):
                return True
    finally:
        os.close(fd)


@dataclass(frozen=True)
class OomEvidence:
    """What the kernel says about a worker killed by SIGKILL."""

    found: str | None
    """Where an out-of-memory kill is recorded (``None``: nowhere that could be read)."""
    looked: str
    """Which records were read, or that none could be, in words."""


def oom_evidence(pid: int, kills_before: int | None) -> OomEvidence:
    """Whether the out-of-memory killer killed ``pid``: the cgroup's counter grew since ``kills_before``, or
    the kernel log names the pid."""
    kills_after = oom_kill_count()
    in_log = kernel_log_oom_kill(pid)
    read = []
    if kills_before is not None and kills_after is not None:
        if kills_after > kills_before:
            return OomEvidence(f"the cgroup's oom_kill counter went from {kills_before} to {kills_after}", "")
        read.append("the cgroup's oom_kill counter")
    if in_log:
        return OomEvidence(f"the kernel log records an out-of-memory kill of pid {pid}", "")
    if in_log is not None:
        read.append("the kernel log")
    looked = (
        f"{' and '.join(read)} record{'s' if len(read) == 1 else ''} no out-of-memory kill"
        if read
        else "neither the kernel log nor the cgroup's oom_kill counter is readable here, so whether it was the "
        "kernel's out-of-memory killer is unknown"
    )
    return OomEvidence(None, looked)
