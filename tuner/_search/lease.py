"""The gate lease: at most one process at a time runs the evidence gate of a study (docs/CLUSTER.md).

The lease is a companion study, ``<study>::gate-lease``, in the study's own storage: creating a study of a name
is atomic in every Optuna storage (study attributes and MLflow tags are only read-then-write), so exactly one
process holds it, and deleting it releases it. The holder records its host, pid and start; a waiter breaks a
lease whose holder died on its own host, and waits out its deadline for another host's.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone

import optuna

from tuner.exits import Declined

_HOST, _PID, _SINCE = "host", "pid", "since"


class GateLeaseTimeout(Declined):
    """Another process held the study's gate lease for longer than the wait allowed (nothing promoted: exit 1)."""


def lease_name(study_name: str) -> str:
    return f"{study_name}::gate-lease"


@contextlib.contextmanager
def gate_lease(
    storage: optuna.storages.BaseStorage,
    study_name: str,
    *,
    wait_s: float,
    poll_s: float = 1.0,
    on_wait: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
) -> Iterator[bool]:
    """Hold ``study_name``'s gate lease for the ``with`` block; yields whether another process held it first.

    ``on_wait`` is told once who holds the lease when this process has to wait; ``cancel`` (Ctrl-C) ends the wait
    with `KeyboardInterrupt`, and another live holder past ``wait_s`` with `GateLeaseTimeout`.
    """
    name = lease_name(study_name)
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        try:
            lease_id = storage.create_new_study([optuna.study.StudyDirection.MINIMIZE], name)
            break
        except optuna.exceptions.DuplicatedStudyError:
            held_id, holder = _holder(storage, name)
            if held_id is not None and _dead_here(holder):
                _break(storage, held_id, holder)
                continue
            if not waited and on_wait is not None:
                on_wait(f"gate: waiting for {_describe(holder)} to finish the gate of study {study_name} ...")
            waited = True
            if time.monotonic() >= deadline:
                raise GateLeaseTimeout(
                    f"study {study_name!r}: {_describe(holder)} has held the gate for more than {wait_s:g} s; "
                    f"if that process is gone, delete the study {name!r} from the storage and run again"
                ) from None
            if cancel is None:
                time.sleep(poll_s)
            elif cancel.wait(poll_s):
                raise KeyboardInterrupt from None
    for key, value in (
        (_HOST, socket.gethostname()),
        (_PID, os.getpid()),
        (_SINCE, datetime.now(timezone.utc).isoformat(timespec="seconds")),
    ):
        storage.set_study_user_attr(lease_id, key, value)
    try:
        yield waited
    finally:
        storage.delete_study(lease_id)


def _holder(storage: optuna.storages.BaseStorage, name: str) -> tuple[int | None, dict[str, object] | None]:
    """The lease study's id and holder attributes; ``(None, None)`` when it vanished meanwhile (released)."""
    try:
        lease_id = storage.get_study_id_from_name(name)
        return lease_id, dict(storage.get_study_user_attrs(lease_id))
    except KeyError:
        return None, None


def _dead_here(holder: dict[str, object] | None) -> bool:
    """Whether the holder ran on this host and its process is gone (a lease just taken has no attributes yet)."""
    pid = holder.get(_PID) if holder else None
    if not holder or holder.get(_HOST) != socket.gethostname() or not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, under another user
    return False


def _break(storage: optuna.storages.BaseStorage, lease_id: int, holder: dict[str, object] | None) -> None:
    """Delete the dead holder's lease, unless another waiter broke it first and took a new one."""
    with contextlib.suppress(KeyError):  # gone: another waiter broke it
        # The same id may be a new lease now (SQLite reuses the highest rowid): its holder says so.
        if dict(storage.get_study_user_attrs(lease_id)) == holder:
            storage.delete_study(lease_id)


def _describe(holder: dict[str, object] | None) -> str:
    if not holder:
        return "another process"
    return f"process {holder.get(_PID)} on {holder.get(_HOST)} (since {holder.get(_SINCE)})"
