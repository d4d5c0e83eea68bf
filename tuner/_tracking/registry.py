"""The good-policy registry: promote, reject, roll back, and read back the decision history.

The experiment tag ``recompute.good_run_id`` names the run whose ``policy.yaml`` is the current
good policy; every change to it is a decision run, so the history is MLflow's alone."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_recompute.mlflow_policy import GOOD_RUN_TAG, POLICY_ARTIFACT
from lightning_recompute.policy import RecomputePolicy
from tuner._tracking.client import TrackingClient, TrackingError, clip_tag, int_or_none
from tuner._tracking.decision_runs import DecisionKind, decision_seq, finish_decision_run, start_decision_run, tag_int
from tuner._tracking.names import (
    DECISION,
    DECISION_ENDED_BY,
    FINGERPRINT,
    KIND,
    NEW_GOOD,
    OWNER,
    PREVIOUS_GOOD,
    PROMOTED_AT,
    REASON,
    REJECT_REASON,
    REJECTED,
    SOURCE_RUN,
    TUNED_MICRO_BATCH,
)

if TYPE_CHECKING:
    from tuner._tracking.sessions import SessionLog


@dataclass(frozen=True)
class GoodPolicy:
    """The policy the experiment currently holds as good, and the evidence it was promoted on."""

    run_id: str
    """The run whose ``policy.yaml`` is the good policy (the experiment tag ``recompute.good_run_id``)."""
    policy: RecomputePolicy
    """The policy itself."""
    fingerprint: str
    """``policy.fingerprint()``."""
    throughput: float | None
    """Measured throughput of that run (its ``measured_throughput`` metric), if it has one."""
    peak_bytes: int | None
    """Measured peak memory of that run, if it has one."""
    promoted_at: datetime | None
    """When it became the good policy (promotion or rollback), UTC."""
    micro_batch: int | None = None
    """The micro-batch it was measured with (``None``: the data module's own)."""


@dataclass(frozen=True)
class Decision:
    """One promotion, rejection or rollback, as recorded in its decision run."""

    run_id: str
    """The decision run."""
    kind: DecisionKind
    """What was decided."""
    seq: int
    """Position in the experiment's decision history (1, 2, ...)."""
    at: datetime
    """When, UTC."""
    reason: str
    """Why, in words."""
    fingerprint: str | None
    """The fingerprint of the policy decided about (promoted, rejected, or restored)."""
    previous_good_run_id: str | None
    """The good run before the decision."""
    new_good_run_id: str | None
    """The good run after it (equal to the previous one for a rejection)."""
    source_run_id: str | None
    """The trial or confirmation run the decision is about."""
    micro_batch: int | None = None
    """The micro-batch the decided policy was tuned for (``None``: not recorded, as in decisions
    made before the tuner recorded it)."""


class PolicyRegistry:
    """The experiment's good policy and the decisions that moved it (promote, reject, rollback).

    Args:
        store: the experiment's client (shared with the `SessionLog` of the same `Tracker`).
        sessions: a decision made while its session run is open nests in that run.
    """

    def __init__(self, store: TrackingClient, sessions: SessionLog | None = None) -> None:
        self.store = store
        self.sessions = sessions

    # ------------------------------------------------------------------ the good policy

    def current_good(self) -> GoodPolicy | None:
        """The experiment's current good policy, or ``None`` before the first promotion."""
        exp = self.store.client.get_experiment(self.store.experiment_id)
        run_id = exp.tags.get(GOOD_RUN_TAG)
        return self._good_policy(run_id) if run_id else None

    def restore_file(self, output_path: str | Path) -> str | None:
        """Make ``output_path`` hold the current good policy; what was wrong with it, or ``None``.

        The file is what training jobs read, so it must match the good policy's fingerprint. When
        it is missing, unreadable, not a policy, or a different policy, the good run's
        ``policy.yaml`` artifact is written over it atomically, and the returned line says what
        was found and what was restored. ``None``: it already matched, or there is no good policy
        to restore (the file is then left alone: it is not the tuner's yet).

        Raises:
            TrackingError: the good run or its artifact is gone.
        """
        good = self.current_good()
        if good is None:
            return None
        out = Path(output_path)
        found = _file_state(out, good.policy)
        if found is None:
            return None
        good.policy.save(out)
        return f"{out} {found}; restored the good policy {good.fingerprint} from MLflow run {good.run_id}"

    def end_dead_decisions(self, grace_s: float) -> list[str]:
        """End KILLED every RUNNING decision run whose owner is dead (SIGKILLed mid-decision); their ids.

        Such a run is not history (only FINISHED decisions are), but left RUNNING it reads in the
        MLflow UI as a decision still being made. A run without an owner tag (an older version's)
        is judged by its start time against ``grace_s``; a decision takes seconds.
        """
        from tuner._liveness import Owner, dead_reason

        ended = []
        for run in self.store.search(f"tags.`{KIND}` = 'decision' and attributes.status = 'RUNNING'"):
            t = run.data.tags
            try:
                owner = Owner.from_dict(json.loads(t[OWNER])) if OWNER in t else None
            except (ValueError, TypeError, KeyError):
                owner = None
            why = dead_reason(owner, None, grace=grace_s, since=run.info.start_time / 1000.0)
            if why is None:
                continue
            self.store.client.set_tag(run.info.run_id, DECISION_ENDED_BY, clip_tag(why))
            self.store.client.set_terminated(run.info.run_id, "KILLED")
            ended.append(run.info.run_id)
        return ended

    def clean_leftovers(self, output_path: str | Path, grace_s: float) -> tuple[str, ...]:
        """End the decision runs of dead processes and remove their temporary policy files; what was done.

        A ``rollback`` or promotion SIGKILLed mid-decision leaves its decision run RUNNING and,
        inside the atomic write, a ``.policy.yaml.*.tmp`` file; every later ``tune`` and
        ``rollback`` calls this first.
        """
        done = [f"decision run {run_id} of a dead process ended KILLED" for run_id in self.end_dead_decisions(grace_s)]
        done += [
            f"removed {tmp}: a temporary file of a killed write" for tmp in remove_stale_temps(output_path, grace_s)
        ]
        return tuple(done)

    def promote(
        self,
        policy: RecomputePolicy,
        *,
        source_run_id: str | None,
        output_path: str | Path,
        reason: str,
        evidence: Mapping[str, Any],
    ) -> str:
        """Make ``policy`` the good policy: write ``output_path`` atomically and record it; the decision run id.

        The good run becomes ``source_run_id`` (the confirmation or trial run that measured the
        policy; it must hold the same policy), or the decision run itself when there is none. If
        recording fails after the file was written, the file is put back as it was.

        Raises:
            TrackingError: the source run holds a different policy.
        """
        previous = self._good_run_id()
        good_run = source_run_id
        if source_run_id is not None:
            self._ensure_run_policy(source_run_id, policy)
        decision_id = start_decision_run(
            self.store,
            DecisionKind.PROMOTE,
            policy,
            reason=reason,
            evidence=evidence,
            previous=previous,
            source_run_id=source_run_id,
            parent_run_id=self._open_session(),
        )
        good_run = good_run or decision_id
        finish_decision_run(
            self.store, decision_id, policy, output_path, previous=previous, new=good_run, rolled_back=False
        )
        return decision_id

    def reject(
        self,
        policy: RecomputePolicy,
        *,
        source_run_id: str | None,
        reason: str,
        evidence: Mapping[str, Any],
    ) -> str:
        """Record that ``policy`` failed the gate, and why; the good policy and its file stay. The decision run id."""
        previous = self._good_run_id()
        decision_id = start_decision_run(
            self.store,
            DecisionKind.REJECT,
            policy,
            reason=reason,
            evidence=evidence,
            previous=previous,
            source_run_id=source_run_id,
            parent_run_id=self._open_session(),
        )
        self.store.client.set_tag(decision_id, NEW_GOOD, previous or "")
        if source_run_id is not None:
            self.store.set_tags(source_run_id, {REJECTED: "true", REJECT_REASON: clip_tag(reason)})
        self.store.client.set_terminated(decision_id, "FINISHED")
        return decision_id

    def can_roll_back(self) -> bool:
        """Whether an earlier good policy exists for `rollback` to restore."""
        return len(self._good_stack()) >= 2

    def rollback(
        self,
        *,
        output_path: str | Path,
        vet: Callable[[GoodPolicy], None] | None = None,
    ) -> GoodPolicy:
        """Restore the good policy before the current one (file and MLflow record); the restored one.

        Rollbacks stack: promote A, promote B, promote C, rollback, rollback leaves A.

        Args:
            output_path: the policy file to write.
            vet: called with the policy to restore before anything changes; raising refuses the
                rollback (``rollback`` checks it against the recipe's current budget).

        Raises:
            TrackingError: there is no earlier good policy, the experiment's good-run tag no
                longer matches the recorded history (someone edited it by hand), or the earlier
                run's artifact was changed after it was logged.
        """
        current = self._good_run_id()
        stack = self._good_stack()
        if current is None or len(stack) < 2:
            have = "no good policy at all" if current is None else f"only the first good policy (run {current})"
            raise TrackingError(
                f"experiment {self.store.experiment!r}: nothing to roll back to; it has {have}. "
                f"`recompute-tune history` lists the decisions."
            )
        if stack[-1] != current:
            raise TrackingError(
                f"experiment {self.store.experiment!r}: tag {GOOD_RUN_TAG} is {current}, but the decision history "
                f"ends at {stack[-1]}; the tag was changed outside the tuner. Set it back or promote again."
            )
        target = stack[-2]
        restored = self._good_policy(target)
        if vet is not None:
            vet(restored)
        decision_id = start_decision_run(
            self.store,
            DecisionKind.ROLLBACK,
            restored.policy,
            reason=f"rolled back from run {current} to run {target}",
            evidence={"rolled_back_run_id": current, "restored_run_id": target},
            previous=current,
            source_run_id=target,
            parent_run_id=self._open_session(),
        )
        finish_decision_run(
            self.store, decision_id, restored.policy, output_path, previous=current, new=target, rolled_back=True
        )
        return self._good_policy(target)

    def history(self) -> list[Decision]:
        """Every completed promotion, rejection and rollback of the experiment, oldest first."""
        out = []
        for run in self._decision_runs():
            t = run.data.tags
            try:
                kind = DecisionKind(t.get(DECISION))
            except ValueError:  # a run tagged a decision by other means, saying nothing the history can show
                continue
            out.append(
                Decision(
                    run_id=run.info.run_id,
                    kind=kind,
                    seq=decision_seq(t),
                    at=datetime.fromtimestamp(run.info.start_time / 1000, tz=timezone.utc),
                    reason=t.get(REASON, ""),
                    fingerprint=t.get(FINGERPRINT),
                    previous_good_run_id=t.get(PREVIOUS_GOOD) or None,
                    new_good_run_id=t.get(NEW_GOOD) or None,
                    source_run_id=t.get(SOURCE_RUN) or None,
                    micro_batch=tag_int(t.get(TUNED_MICRO_BATCH)),
                )
            )
        return out

    def _open_session(self) -> str | None:
        return self.sessions.open_run_id if self.sessions is not None else None

    def _good_run_id(self) -> str | None:
        return self.store.client.get_experiment(self.store.experiment_id).tags.get(GOOD_RUN_TAG) or None

    def _ensure_run_policy(self, run_id: str, policy: RecomputePolicy) -> None:
        held = _run_policy(self.store, run_id)
        if held is not None and held.fingerprint() != policy.fingerprint():
            raise TrackingError(
                f"run {run_id} measured policy {held.fingerprint()}, not the promoted {policy.fingerprint()}; "
                f"promote the policy together with the run that measured it"
            )
        if held is None or (policy.tuned_for is not None and held.tuned_for != policy.tuned_for):
            # A run logged by other means (a hand-made run, an older tuner), or one whose file
            # lacks what the policy was tuned for: the good run's artifact is what "mlflow:"
            # training jobs read, so it must be the promoted file, tuned_for included.
            self.store.client.log_text(run_id, policy.to_yaml(), POLICY_ARTIFACT)

    def _good_policy(self, run_id: str) -> GoodPolicy:
        from mlflow.exceptions import MlflowException

        try:
            run = self.store.client.get_run(run_id)
        except MlflowException as err:
            raise TrackingError(
                f"experiment {self.store.experiment!r}: good run {run_id} does not exist ({err.error_code})"
            ) from None
        policy = _run_policy(self.store, run_id)
        if policy is None:
            raise TrackingError(
                f"experiment {self.store.experiment!r}: good run {run_id} has no {POLICY_ARTIFACT} artifact"
            )
        m, p, t = run.data.metrics, run.data.params, run.data.tags
        recorded = t.get(FINGERPRINT)
        if recorded and policy.fingerprint() != recorded:
            # The check the plugin's "mlflow:" loader makes: restoring an edited artifact would put a
            # policy nobody measured into the file training jobs read.
            raise TrackingError(
                f"experiment {self.store.experiment!r}: good run {run_id}: artifact {POLICY_ARTIFACT!r} "
                f"has fingerprint {policy.fingerprint()}, but the run recorded {recorded} (tag {FINGERPRINT}); "
                f"the artifact was changed after the run logged it, so it is not restored and the policy file "
                f"is left as it is. Put the artifact back, or run `recompute-tune RECIPE` to measure and promote "
                f"a policy again"
            )
        at = t.get(PROMOTED_AT)
        mb = p.get("micro_batch")
        return GoodPolicy(
            run_id=run_id,
            policy=policy,
            fingerprint=policy.fingerprint(),
            throughput=m.get("measured_throughput"),
            peak_bytes=int_or_none(m.get("measured_peak_bytes")),
            promoted_at=datetime.fromisoformat(at) if at else None,
            micro_batch=int(mb) if mb and mb.isdigit() else None,
        )

    def _decision_runs(self) -> list[Any]:
        runs = self.store.search(f"tags.`{KIND}` = 'decision' and attributes.status = 'FINISHED'")
        return sorted(runs, key=lambda r: (decision_seq(r.data.tags), r.info.start_time))

    def _good_stack(self) -> list[str]:
        """Good run ids, oldest first, as the completed decisions leave them (promote pushes, rollback pops)."""
        stack: list[str] = []
        for run in self._decision_runs():
            t = run.data.tags
            if t.get(DECISION) == DecisionKind.PROMOTE and t.get(NEW_GOOD):
                stack.append(t[NEW_GOOD])
            elif t.get(DECISION) == DecisionKind.ROLLBACK and stack:
                stack.pop()
        return stack


def _run_policy(store: TrackingClient, run_id: str) -> RecomputePolicy | None:
    """The ``policy.yaml`` of a run, or ``None`` when it has none."""
    names = {f.path for f in store.client.list_artifacts(run_id)}
    if POLICY_ARTIFACT not in names:
        return None
    with tempfile.TemporaryDirectory(prefix="recompute-policy-") as tmp:
        local = store.client.download_artifacts(run_id, POLICY_ARTIFACT, tmp)
        return RecomputePolicy.load(local)


def remove_stale_temps(output_path: str | Path, older_than_s: float) -> list[Path]:
    """Remove the temporary files of atomic writes to ``output_path`` left by a killed writer; those removed.

    `lightning_recompute.atomic.atomic_write` writes ``.<name>.<random>.tmp`` beside the file and
    renames it over the file; a writer SIGKILLed in between leaves it forever. A write takes
    milliseconds, so one older than ``older_than_s`` (the liveness grace period) has no live
    writer; a younger one may be another worker's write in progress and is left alone.
    """
    out = Path(output_path)
    removed = []
    now = time.time()
    for tmp in out.parent.glob(f".{out.name}.*.tmp"):
        try:
            if now - tmp.stat().st_mtime > older_than_s:
                tmp.unlink()
                removed.append(tmp)
        except OSError:  # gone meanwhile (another worker cleaned it), or not ours to remove
            continue
    return removed


def _file_state(path: Path, good: RecomputePolicy) -> str | None:
    """What is wrong with the policy file at ``path`` for the good policy ``good``; ``None`` if nothing.

    The file's ``tuned_for`` counts like its layers: training jobs read it to warn when they run at
    another batch size, so a hand-edited one (micro_batch 4 -> 64) silences that warning.
    """
    from lightning_recompute.errors import PolicyError

    fingerprint = good.fingerprint()
    if not path.exists():
        return "was missing"
    try:
        held = RecomputePolicy.load(path)
    except (OSError, PolicyError) as err:
        return f"was not a readable policy ({clip_tag(str(err), 200)})"
    if held.fingerprint() != fingerprint:
        return f"held policy {held.fingerprint()}, not the good policy {fingerprint}"
    if held.tuned_for != good.tuned_for:
        mine = {} if held.tuned_for is None else held.tuned_for.to_dict()
        theirs = {} if good.tuned_for is None else good.tuned_for.to_dict()
        changed = ", ".join(
            f"{key} {mine.get(key)!r} (the good run's: {theirs.get(key)!r})"
            for key in sorted(set(mine) | set(theirs))
            if mine.get(key) != theirs.get(key)
        )
        return f"held the good policy {fingerprint} with another tuned_for: {clip_tag(changed, 500)}"
    return None
