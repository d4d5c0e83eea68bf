"""The gate lease: one process at a time runs a study's gate (docs/CLUSTER.md). It is a companion study,
``<study>::gate-lease``: creating a study of a name is atomic in every Optuna storage (study attributes and MLflow
tags are only read-then-write). A lease whose holder died on this host is broken; another host's is waited for."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone

import optuna

from tuner._liveness import Owner
from tuner.exits import Declined


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
    """Hold the gate lease for the ``with`` block; yields whether another process held it first. ``cancel``
    (Ctrl-C) ends the wait with `KeyboardInterrupt`, a live holder past ``wait_s`` with `GateLeaseTimeout`."""
    name = lease_name(study_name)
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        try:
            lease_id = storage.create_new_study([optuna.study.StudyDirection.MINIMIZE], name)
            break
        except optuna.exceptions.DuplicatedStudyError:
            pass
        try:
            held_id = storage.get_study_id_from_name(name)
            holder = dict(storage.get_study_user_attrs(held_id))
        except KeyError:
            continue  # released meanwhile
        owner = Owner.from_dict(holder)  # None: a lease just taken has no attributes yet
        if owner is not None and owner.gone_here():
            # The same id may be a new lease now (SQLite reuses the highest rowid): its holder says so.
            with contextlib.suppress(KeyError):  # gone: another waiter broke it
                if dict(storage.get_study_user_attrs(held_id)) == holder:
                    storage.delete_study(held_id)
            continue
        who = f"process {owner.pid} on {owner.host} (since {holder.get('since')})" if owner else "another process"
        if not waited and on_wait is not None:
            on_wait(f"gate: waiting for {who} to finish the gate of study {study_name} ...")
        waited = True
        if time.monotonic() >= deadline:
            raise GateLeaseTimeout(
                f"study {study_name!r}: {who} has held the gate for more than {wait_s:g} s; "
                f"if that process is gone, delete the study {name!r} from the storage and run again"
            )
        if cancel is None:
            time.sleep(poll_s)
        elif cancel.wait(poll_s):
            raise KeyboardInterrupt
    since = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for key, value in {**Owner.me().to_dict(), "since": since}.items():
        storage.set_study_user_attr(lease_id, key, value)
    try:
        yield waited
    finally:
        storage.delete_study(lease_id)
