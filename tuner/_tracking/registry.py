"""The good-policy registry: promote, reject, roll back, and read back the decision history.

The experiment tag ``recompute.good_run_id`` names the run whose ``policy.yaml`` is the good policy; every change
to it is a decision run, so the history is MLflow's alone. The policy file is written only once the decision run
holds its new good run, and a failure puts the file and the record back as they were.
"""

from __future__ import annotations

import enum
import json
import tempfile
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_recompute.atomic import atomic_write
from lightning_recompute.mlflow_policy import GOOD_RUN_TAG, POLICY_ARTIFACT
from lightning_recompute.policy import RecomputePolicy
from tuner._liveness import kill_point
from tuner._tracking.client import TrackingClient, TrackingError, clip_tag, finite
from tuner._tracking.names import (
    DECISION,
    DECISION_ENDED_BY,
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
    REJECT_REASON,
    REJECTED,
    ROLLED_BACK,
    SOURCE_RUN,
    TUNED_MICRO_BATCH,
)
from tuner._tracking.sessions import dead_owner

if TYPE_CHECKING:
    from tuner._tracking.sessions import SessionLog


class DecisionKind(str, enum.Enum):
    """What a decision run decided; its value is the run's ``recompute.decision`` tag."""

    PROMOTE = "promote"
    REJECT = "reject"
    ROLLBACK = "rollback"


@dataclass(frozen=True)
class GoodPolicy:
    """The policy the experiment holds as good (the run whose ``policy.yaml`` it is), and its figures."""

    run_id: str
    policy: RecomputePolicy
    fingerprint: str
    throughput: float | None
    peak_bytes: int | None
    promoted_at: datetime | None  # UTC, by promotion or rollback
    micro_batch: int | None = None  # None: the data module's own


@dataclass(frozen=True)
class Decision:
    """One promotion, rejection or rollback, as recorded in its decision run."""

    run_id: str
    kind: DecisionKind
    seq: int  # position in the experiment's decision history (1, 2, ...)
    at: datetime
    reason: str
    fingerprint: str | None  # of the policy promoted, rejected or restored
    previous_good_run_id: str | None
    new_good_run_id: str | None  # the previous one for a rejection
    source_run_id: str | None  # the trial or confirmation run decided about
    micro_batch: int | None = None  # tuned for; None in decisions recorded before the tuner kept it


class PolicyRegistry:
    """The experiment's good policy and the decisions that moved it; a decision made while ``sessions`` has its
    session run open nests in that run."""

    def __init__(self, store: TrackingClient, sessions: SessionLog | None = None) -> None:
        self.store = store
        self.sessions = sessions

    def current_good(self) -> GoodPolicy | None:
        """The experiment's current good policy, or ``None`` before the first promotion."""
        run_id = self._good_run_id()
        return self._good_policy(run_id) if run_id else None

    def restore_file(self, output_path: str | Path) -> str | None:
        """Make ``output_path`` (what training jobs read) hold the current good policy; what was wrong with it, or
        ``None`` when it matched or there is no good policy. A `TrackingError` when the good run or artifact is gone."""
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
        """End KILLED every RUNNING decision run whose owner is dead (killed mid-decision); their ids."""
        ended = []
        for run in self.store.search(f"tags.`{KIND}` = 'decision' and attributes.status = 'RUNNING'"):
            why = dead_owner(run, grace_s, beats=False)
            if why is None:
                continue
            self.store.client.set_tag(run.info.run_id, DECISION_ENDED_BY, clip_tag(why))
            self.store.client.set_terminated(run.info.run_id, "KILLED")
            ended.append(run.info.run_id)
        return ended

    def clean_leftovers(self, output_path: str | Path, grace_s: float) -> tuple[str, ...]:
        """End dead processes' decision runs and remove their temporary policy files; what was done."""
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
        The good run is ``source_run_id`` (a `TrackingError` if it measured another policy), or the decision run."""
        previous = self._good_run_id()
        if source_run_id is not None:
            self._ensure_run_policy(source_run_id, policy)
        decision_id = self._start(DecisionKind.PROMOTE, policy, reason, evidence, previous, source_run_id)
        self._finish(decision_id, policy, output_path, previous=previous, new=source_run_id or decision_id)
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
        decision_id = self._start(DecisionKind.REJECT, policy, reason, evidence, previous, source_run_id)
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
        """Restore the good policy before the current one (file and record); the restored one. Rollbacks stack.

        ``vet`` is called with the policy to restore before anything changes; raising refuses the rollback. A
        `TrackingError` when there is none, or the good-run tag or the earlier artifact was edited by hand.
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
        decision_id = self._start(
            DecisionKind.ROLLBACK,
            restored.policy,
            f"rolled back from run {current} to run {target}",
            {"rolled_back_run_id": current, "restored_run_id": target},
            current,
            target,
        )
        self._finish(decision_id, restored.policy, output_path, previous=current, new=target, rolled_back=True)
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
                    seq=_decision_seq(t),
                    at=datetime.fromtimestamp(run.info.start_time / 1000, tz=timezone.utc),
                    reason=t.get(REASON, ""),
                    fingerprint=t.get(FINGERPRINT),
                    previous_good_run_id=t.get(PREVIOUS_GOOD) or None,
                    new_good_run_id=t.get(NEW_GOOD) or None,
                    source_run_id=t.get(SOURCE_RUN) or None,
                    micro_batch=_tag_int(t.get(TUNED_MICRO_BATCH)),
                )
            )
        return out

    def _start(
        self,
        kind: DecisionKind,
        policy: RecomputePolicy,
        reason: str,
        evidence: Mapping[str, Any],
        previous: str | None,
        source_run_id: str | None,
    ) -> str:
        """Open a decision run holding ``policy`` and ``evidence``, numbered after the last; its id. Its owner tag
        lets a later session end it if this process dies mid-decision; it ends FAILED if its artifacts fail."""
        from tuner._liveness import Owner

        store = self.store
        seq = 1 + max((_decision_seq(r.data.tags) for r in store.search(f"tags.`{KIND}` = 'decision'")), default=0)
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
        tags[OWNER] = json.dumps(Owner.me().to_dict())
        if policy.tuned_for is not None and policy.tuned_for.micro_batch is not None:
            tags[TUNED_MICRO_BATCH] = str(policy.tuned_for.micro_batch)
        parent = self.sessions.open_run_id if self.sessions is not None else None
        if parent:
            tags[PARENT] = parent
        run = store.client.create_run(store.experiment_id, tags=tags, run_name=f"{kind.value} {policy.fingerprint()}")
        run_id = run.info.run_id
        try:
            store.client.log_text(run_id, policy.to_yaml(), POLICY_ARTIFACT)
            store.log_json(run_id, EVIDENCE_JSON, evidence)
        except BaseException:
            store.client.set_terminated(run_id, "FAILED")
            raise
        return run_id

    def _finish(
        self,
        decision_id: str,
        policy: RecomputePolicy,
        output_path: str | Path,
        *,
        previous: str | None,
        new: str,
        rolled_back: bool = False,
    ) -> None:
        """Write the file, then move the experiment's record; undo both if the record fails."""
        store = self.store
        out = Path(output_path)
        old_bytes = out.read_bytes() if out.exists() else None
        try:
            store.client.set_tag(decision_id, NEW_GOOD, new)
            kill_point("rollback" if rolled_back else "")  # test hooks; see tuner._liveness
            policy.save(out)
            kill_point("after_write")
            now = datetime.now(timezone.utc).isoformat()
            store.set_tags(new, {GOOD: "true", PROMOTED_AT: now, PROMOTED: "true"})
            if previous and previous != new:
                prev_tags = {GOOD: "false"}
                if rolled_back:
                    prev_tags[ROLLED_BACK] = "true"
                store.set_tags(previous, prev_tags)
            store.client.set_experiment_tag(store.experiment_id, GOOD_RUN_TAG, new)
        except BaseException:
            # A file that says B while MLflow says A is worse than either. Each undo is best effort (the store
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
            # A run logged by other means, or whose file lacks tuned_for: "mlflow:" training jobs read it.
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
            # The plugin's "mlflow:" loader checks the same: an edited artifact is a policy nobody measured.
            raise TrackingError(
                f"experiment {self.store.experiment!r}: good run {run_id}: artifact {POLICY_ARTIFACT!r} "
                f"has fingerprint {policy.fingerprint()}, but the run recorded {recorded} (tag {FINGERPRINT}); "
                f"the artifact was changed after the run logged it, so it is not restored and the policy file "
                f"is left as it is. Put the artifact back, or run `recompute-tune RECIPE` to measure and promote "
                f"a policy again"
            )
        at = t.get(PROMOTED_AT)
        peak = finite(m.get("measured_peak_bytes"))
        return GoodPolicy(
            run_id=run_id,
            policy=policy,
            fingerprint=policy.fingerprint(),
            throughput=m.get("measured_throughput"),
            peak_bytes=None if peak is None else int(peak),
            promoted_at=datetime.fromisoformat(at) if at else None,
            micro_batch=_tag_int(p.get("micro_batch")),
        )

    def _decision_runs(self) -> list[Any]:
        runs = self.store.search(f"tags.`{KIND}` = 'decision' and attributes.status = 'FINISHED'")
        return sorted(runs, key=lambda r: (_decision_seq(r.data.tags), r.info.start_time))

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
    names = {f.path for f in store.client.list_artifacts(run_id)}
    if POLICY_ARTIFACT not in names:
        return None
    with tempfile.TemporaryDirectory(prefix="recompute-policy-") as tmp:
        local = store.client.download_artifacts(run_id, POLICY_ARTIFACT, tmp)
        return RecomputePolicy.load(local)


def remove_stale_temps(output_path: str | Path, older_than_s: float) -> list[Path]:
    """Remove the ``.<name>.<random>.tmp`` files a killed `lightning_recompute.atomic.atomic_write` left beside
    ``output_path``; those removed. A younger one than ``older_than_s`` may be a write in progress."""
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
    Its ``tuned_for`` counts too: training jobs warn from it when they run at another batch size."""
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


def _decision_seq(tags: Mapping[str, str]) -> int:
    """A decision run's position in the history; 0 when its tag (editable in the UI) is not a number."""
    return _tag_int(tags.get(DECISION_SEQ)) or 0


def _tag_int(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None
