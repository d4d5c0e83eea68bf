"""Session runs whose worker died: found by their owner and heartbeat tags, and ended, so that the
MLflow UI never shows a session running that no process runs."""

from __future__ import annotations

import json

from tuner._tracking.client import TrackingClient, clip_tag
from tuner._tracking.names import HEARTBEAT, KIND, OWNER, PARENT, SESSION_ENDED_BY, STUDY

__all__ = ["end_dead_sessions"]


def end_dead_sessions(store: TrackingClient, study_name: str, grace_s: float, *, own_run_id: str | None) -> list[str]:
    """End KILLED every RUNNING session run of ``study_name`` whose owner is dead (but ``own_run_id``);
    their ids.

    Its nested runs still RUNNING end FAILED. A session run without an owner tag (an older
    version's) is judged by its start time against ``grace_s``, like another host's.
    """
    from tuner._liveness import Owner, dead_reason

    quoted = study_name.replace("'", "\\'")
    ended = []
    for run in store.search(
        f"tags.`{KIND}` = 'session' and tags.`{STUDY}` = '{quoted}' and attributes.status = 'RUNNING'"
    ):
        if run.info.run_id == own_run_id:
            continue
        t = run.data.tags
        try:
            owner = Owner.from_dict(json.loads(t[OWNER])) if OWNER in t else None
            beat = float(t[HEARTBEAT]) if HEARTBEAT in t else None
        except (ValueError, TypeError):
            owner, beat = None, None
        why = dead_reason(owner, beat, grace=grace_s, since=run.info.start_time / 1000.0)
        if why is None:
            continue
        run_id = run.info.run_id
        store.client.set_tag(run_id, SESSION_ENDED_BY, clip_tag(why))
        for child in store.search(f"tags.`{PARENT}` = '{run_id}' and attributes.status = 'RUNNING'"):
            store.client.set_terminated(child.info.run_id, "FAILED")
        store.client.set_terminated(run_id, "KILLED")
        ended.append(run_id)
    return ended
