"""Recognising an out-of-memory failure: the child's exception, a dead child's output, and whether the kernel's
out-of-memory killer sent a SIGKILL (which ``kill -9``, schedulers and container runtimes send too)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
KMSG = Path("/dev/kmsg")  # one record per read; readable by root, or where kernel.dmesg_restrict is 0
OOM_MARKERS = ("CUDA out of memory", "DefaultCPUAllocator: can't allocate memory", "OutOfMemoryError")


def is_oom_error(err: BaseException) -> bool:
    """Whether ``err`` or an exception it was raised from is an out-of-memory error."""
    import torch

    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, torch.OutOfMemoryError) or (
            isinstance(cur, RuntimeError) and any(m in str(cur) for m in OOM_MARKERS[:2])
        ):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def oom_kill_count() -> int | None:
    """The out-of-memory kills in this process's cgroup (v2 ``memory.events``, v1 ``memory.oom_control``; in a
    container its path is outside the view, so the mount's root is read next); ``None``: not readable."""
    try:
        lines = Path("/proc/self/cgroup").read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    files = []
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        if controllers == "":
            files += [CGROUP_ROOT / path.lstrip("/") / "memory.events", CGROUP_ROOT / "memory.events"]
        elif "memory" in controllers.split(","):
            root = CGROUP_ROOT / "memory"
            files += [root / path.lstrip("/") / "memory.oom_control", root / "memory.oom_control"]
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except OSError:
            continue
        for key, _, value in (line.partition(" ") for line in text.splitlines()):
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def kernel_log_oom_kill(pid: int) -> bool | None:
    """Whether the kernel log records an out-of-memory kill of ``pid``; ``None``: the log is not readable."""
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


def oom_evidence(pid: int, kills_before: int | None) -> tuple[str | None, str]:
    """Where an out-of-memory kill of ``pid`` is recorded (``None``: nowhere), and which records were read."""
    kills_after, in_log = oom_kill_count(), kernel_log_oom_kill(pid)
    read = []
    if kills_before is not None and kills_after is not None:
        if kills_after > kills_before:
            return f"the cgroup's oom_kill counter went from {kills_before} to {kills_after}", ""
        read.append("the cgroup's oom_kill counter")
    if in_log:
        return f"the kernel log records an out-of-memory kill of pid {pid}", ""
    if in_log is not None:
        read.append("the kernel log")
    if not read:
        return None, (
            "neither the kernel log nor the cgroup's oom_kill counter is readable here, so whether it was the "
            "kernel's out-of-memory killer is unknown"
        )
    return None, f"{' and '.join(read)} record{'s' if len(read) == 1 else ''} no out-of-memory kill"
