"""A decision run: opened with its policy and evidence, then finished by writing the policy file and moving
the experiment's good-policy record, or undone as far as the store still answers.

`PolicyRegistry` decides (promote, reject, roll back); this module writes the decision run and keeps
the policy file and MLflow's record in step: the file is written only once the decision run holds
its new good run, and a failure puts the file back and the record as it was.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from contextlib import suppress
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lightning_recompute.atomic import atomic_write
from lightning_recompute.mlflow_policy import GOOD_RUN_TAG, POLICY_ARTIFACT
from lightning_recompute.policy import RecomputePolicy
from tuner._liveness import kill_point
from tuner._tracking.client import TrackingClient, clip_tag
from tuner._tracking.names import (
    DECISION,
    DECISION_SEQ,
    EVIDENCE_JSON,
    FINGERPRINT,
    GOOD,
    KIND,
    NEW_GOOD,
    OWNER,
    PARENT,
    PREVIOUS_GOOD,
    PROMOTED,
    PROMOTED_AT,
    REASON,
    ROLLED_BACK,
    SOURCE_RUN,
    TUNED_MICRO_BATCH,
)

__all__ = ["DecisionKind", "decision_seq", "finish_decision_run", "start_decision_run", "tag_int"]


class DecisionKind(str, enum.Enum):
    """What a decision run decided; its value is the run's ``recompute.decision`` tag."""

    PROMOTE = "promote"
    REJECT = "reject"
    ROLLBACK = "rollback"


def start_decision_run(
    store: TrackingClient,
    kind: DecisionKind,
    policy: RecomputePolicy,
    *,
    reason: str,
    evidence: Mapping[str, Any],
    previous: str | None,
    source_run_id: str | None,
    parent_run_id: str | None,
) -> str:
    """Open a decision run (``kind``: promote, reject, rollback) holding ``policy`` and the ``evidence``; its id.

    Its sequence number follows the experiment's last decision; its owner tag lets a later session end
    it if this process dies mid-decision. It ends FAILED if its artifacts cannot be written.
    """
    seq = 1 + max((decision_seq(r.data.tags) for r in store.search(f"tags.`{KIND}` = 'decision'")), default=0)
    tags = {
        KIND: "decision",
        DECISION: kind.value,
        DECISION_SEQ: str(seq),
        REASON: clip_tag(reason),
        PREVIOUS_GOOD: previous or "",
        FINGERPRINT: policy.fingerprint(),
    }
    if source_run_id:
        tags[SOURCE_RUN] = source_run_id
    from tuner._liveness import Owner

    tags[OWNER] = json.dumps(Owner.me().to_dict())  # a later run ends it if this process dies mid-decision
    if policy.tuned_for is not None and policy.tuned_for.micro_batch is not None:
        tags[TUNED_MICRO_BATCH] = str(policy.tuned_for.micro_batch)
    if parent_run_id:
        tags[PARENT] = parent_run_id
    run = store.client.create_run(store.experiment_id, tags=tags, run_name=f"{kind.value} {policy.fingerprint()}")
    run_id = run.info.run_id
    try:
        store.client.log_text(run_id, policy.to_yaml(), POLICY_ARTIFACT)
        store.log_json(run_id, EVIDENCE_JSON, evidence)
    except BaseException:
        store.client.set_terminated(run_id, "FAILED")
        raise
    return run_id


def finish_decision_run(
    store: TrackingClient,
    decision_id: str,
    policy: RecomputePolicy,
    output_path: str | Path,
    *,
    previous: str | None,
    new: str,
    rolled_back: bool,
) -> None:
    """Write the file, then move the experiment's record; undo the file if the record fails."""
    out = Path(output_path)
    old_bytes = out.read_bytes() if out.exists() else None
    try:
        store.client.set_tag(decision_id, NEW_GOOD, new)
        kill_point("rollback" if rolled_back else "")  # a test hook; see tuner._liveness
        policy.save(out)
        kill_point("after_write")  # a test hook; a no-op unless the fault-injection test sets it
        now = datetime.now(timezone.utc).isoformat()
        store.set_tags(new, {GOOD: "true", PROMOTED_AT: now, PROMOTED: "true"})
        if previous and previous != new:
            prev_tags = {GOOD: "false"}
            if rolled_back:
                prev_tags[ROLLED_BACK] = "true"
            store.set_tags(previous, prev_tags)
        store.client.set_experiment_tag(store.experiment_id, GOOD_RUN_TAG, new)
    except BaseException:
        # A file that says B while MLflow says A is worse than either: put the file back, and
        # the record as far as the store still answers. Each undo is best effort (the store
        # may be what failed); the original error is the one worth raising.
        try:
            if old_bytes is not None:
                atomic_write(out, old_bytes)
            elif out.exists():
                out.unlink()
        finally:
            with suppress(Exception):
                if previous:
                    store.client.set_experiment_tag(store.experiment_id, GOOD_RUN_TAG, previous)
            with suppress(Exception):
                if new != previous:
                    store.client.set_tag(new, GOOD, "false")
            with suppress(Exception):
                if previous and previous != new:
                    store.client.set_tag(previous, GOOD, "true")
            with suppress(Exception):
                store.client.set_terminated(decision_id, "FAILED")
        raise
    store.client.set_terminated(decision_id, "FINISHED")


def decision_seq(tags: Mapping[str, str]) -> int:
    """A decision run's position in the history; 0 (first, then by start time) when its tag is not a number.

    The tag is editable in the MLflow UI; one hand-edited or foreign run must not make the whole
    history unreadable (``history`` used to fail with ``ValueError``).
    """
    return tag_int(tags.get(DECISION_SEQ)) or 0


def tag_int(value: str | None) -> int | None:
    """A tag holding a whole number, or ``None`` (absent or not a number: a run logged by other means)."""
    return int(value) if value and value.isdigit() else None
