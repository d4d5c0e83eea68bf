"""The good policy: promote, reject, roll back, and the decision history. Every change to the experiment's good
run is a decision run, so the history is MLflow's alone; the policy file is written only once the decision run
holds its new good run, and a failure puts the file and the record back as they were."""

from __future__ import annotations

import enum
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lightning_recompute.atomic import atomic_write
from lightning_recompute.errors import PolicyError
from lightning_recompute.mlflow_policy import GOOD_RUN_TAG, POLICY_ARTIFACT
from lightning_recompute.policy import RecomputePolicy
from lightning_recompute.units import jsonable
from tuner._liveness import kill_point
from tuner._tracking import names as N
from tuner._tracking.client import TrackingClient, TrackingError, clip_tag, finite
from tuner._tracking.sessions import SessionLog, _owner


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

    def __init__(self, store: TrackingClient, sessions: SessionLog) -> None:
        self.store = store
        self.sessions = sessions

    def current_good(self) -> GoodPolicy | None:
        """The experiment's current good policy, or ``None`` before the first promotion."""
        run_id = self._good_run_id()
        return self._good_policy(run_id) if run_id else None

    def restore_file(self, output_path: str | Path) -> str | None:
        """Make ``output_path`` (what training jobs read) hold the current good policy; what was wrong with it, or
        ``None`` when it matched or there is no good policy. A `TrackingError` when the good run or artifact is gone."""
        good, out = self.current_good(), Path(output_path)
        found = None if good is None else _file_state(out, good.policy)
        if good is None or found is None:
            return None
        good.policy.save(out)
        return f"{out} {found}; restored the good policy {good.fingerprint} from MLflow run {good.run_id}"

    def clean_leftovers(self, output_path: str | Path, grace_s: float) -> tuple[str, ...]:
        """End KILLED the decision runs of processes killed mid-decision and remove the temporary files a killed
        `atomic_write` left (one younger than ``grace_s`` may be a write in progress); what was done."""
        ended = self.sessions.end_dead(f"tags.`{N.KIND}` = 'decision'", N.DECISION_ENDED_BY, grace_s)
        done = [f"decision run {run_id} of a dead process ended KILLED" for run_id in ended]
        out = Path(output_path)
        for tmp in out.parent.glob(f".{out.name}.*.tmp"):
            with suppress(OSError):  # gone meanwhile (another worker cleaned it), or not ours to remove
                if time.time() - tmp.stat().st_mtime > grace_s:
                    tmp.unlink()
                    done.append(f"removed {tmp}: a temporary file of a killed write")
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
            held = _run_policy(self.store, source_run_id)
            if held is not None and held.fingerprint() != policy.fingerprint():
                raise TrackingError(
                    f"run {source_run_id} measured policy {held.fingerprint()}, not the promoted "
                    f"{policy.fingerprint()}; promote the policy together with the run that measured it"
                )
            if held is None or (policy.tuned_for is not None and held.tuned_for != policy.tuned_for):
                # A run logged by other means, or whose file lacks tuned_for: "mlflow:" training jobs read it.
                self.store.client.log_text(source_run_id, policy.to_yaml(), POLICY_ARTIFACT)
        with self._decision(DecisionKind.PROMOTE, policy, reason, evidence, previous, source_run_id) as decision_id:
            self._move_good(decision_id, policy, output_path, previous=previous, new=source_run_id or decision_id)
        return decision_id

    def reject(
        self, policy: RecomputePolicy, *, source_run_id: str | None, reason: str, evidence: Mapping[str, Any]
    ) -> str:
        """Record that ``policy`` failed the gate, and why; the good policy and its file stay. The decision run id."""
        previous = self._good_run_id()
        with self._decision(DecisionKind.REJECT, policy, reason, evidence, previous, source_run_id) as decision_id:
            self.store.client.set_tag(decision_id, N.NEW_GOOD, previous or "")
            if source_run_id is not None:
                self.store.log_batch(source_run_id, tags={N.REJECTED: "true", N.REJECT_REASON: reason})
        return decision_id

    def can_roll_back(self) -> bool:
        """Whether an earlier good policy exists for `rollback` to restore."""
        return len(self._good_stack()) >= 2

    def rollback(self, *, output_path: str | Path, vet: Callable[[GoodPolicy], None] | None = None) -> GoodPolicy:
        """Restore the good policy before the current one (file and record; rollbacks stack) unless ``vet`` raises;
        `TrackingError` when there is none, or the good-run tag or the earlier artifact was edited by hand."""
        current, stack = self._good_run_id(), self._good_stack()
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
        evidence = {"rolled_back_run_id": current, "restored_run_id": target}
        reason = f"rolled back from run {current} to run {target}"
        with self._decision(DecisionKind.ROLLBACK, restored.policy, reason, evidence, current, target) as decision_id:
            self._move_good(decision_id, restored.policy, output_path, previous=current, new=target, rolled_back=True)
        return self._good_policy(target)

    def history(self) -> list[Decision]:
        """Every completed promotion, rejection and rollback of the experiment, oldest first."""
        out = []
        runs = self.store.search(f"tags.`{N.KIND}` = 'decision' and attributes.status = 'FINISHED'")
        for run in sorted(runs, key=lambda r: (_decision_seq(r.data.tags), r.info.start_time)):
            t = run.data.tags
            if t.get(N.DECISION) not in set(DecisionKind):
                continue  # a run tagged a decision by other means, saying nothing the history can show
            out.append(
                Decision(
                    run_id=run.info.run_id,
                    kind=DecisionKind(t[N.DECISION]),
                    seq=_decision_seq(t),
                    at=datetime.fromtimestamp(run.info.start_time / 1000, tz=timezone.utc),
                    reason=t.get(N.REASON, ""),
                    fingerprint=t.get(N.FINGERPRINT),
                    previous_good_run_id=t.get(N.PREVIOUS_GOOD) or None,
                    new_good_run_id=t.get(N.NEW_GOOD) or None,
                    source_run_id=t.get(N.SOURCE_RUN) or None,
                    micro_batch=_tag_int(t.get(N.TUNED_MICRO_BATCH)),
                )
            )
        return out

    @contextmanager
    def _decision(
        self,
        kind: DecisionKind,
        policy: RecomputePolicy,
        reason: str,
        evidence: Mapping[str, Any],
        previous: str | None,
        source_run_id: str | None,
    ) -> Iterator[str]:
        """A decision run holding ``policy`` and ``evidence``, numbered after the last, nested in the open session
        run; its owner tag lets a later session end it if this process dies mid-decision."""
        seq = 1 + max(
            (_decision_seq(r.data.tags) for r in self.store.search(f"tags.`{N.KIND}` = 'decision'")), default=0
        )
        micro_batch = None if policy.tuned_for is None else policy.tuned_for.micro_batch
        tags = {
            N.KIND: "decision",
            N.DECISION: kind.value,
            N.DECISION_SEQ: str(seq),
            N.REASON: reason,
            N.PREVIOUS_GOOD: previous or "",
            N.FINGERPRINT: policy.fingerprint(),
            N.OWNER: _owner(),
            N.SOURCE_RUN: source_run_id or None,
            N.TUNED_MICRO_BATCH: None if micro_batch is None else str(micro_batch),
            N.PARENT: self.sessions.open_run_id,
        }
        with self.store.run(f"{kind.value} {policy.fingerprint()}", tags) as run_id:
            self.store.client.log_text(run_id, policy.to_yaml(), POLICY_ARTIFACT)
            self.store.client.log_dict(run_id, jsonable(evidence), N.EVIDENCE_JSON)
            yield run_id

    def _move_good(
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
        store, client, out = self.store, self.store.client, Path(output_path)
        old_bytes = out.read_bytes() if out.exists() else None
        try:
            client.set_tag(decision_id, N.NEW_GOOD, new)
            kill_point("rollback" if rolled_back else "")  # test hooks; see tuner._liveness
            policy.save(out)
            kill_point("after_write")
            now = datetime.now(timezone.utc).isoformat()
            store.log_batch(new, tags={N.GOOD: "true", N.PROMOTED_AT: now, N.PROMOTED: "true"})
            if previous and previous != new:
                store.log_batch(previous, tags={N.GOOD: "false", **({N.ROLLED_BACK: "true"} if rolled_back else {})})
            client.set_experiment_tag(store.experiment_id, GOOD_RUN_TAG, new)
        except BaseException:
            # A file that says B while MLflow says A is worse than either. Each undo is best effort (the store
            # may be what failed); the original error is the one worth raising (the decision run ends FAILED).
            try:
                if old_bytes is not None:
                    atomic_write(out, old_bytes)
                elif out.exists():
                    out.unlink()
            finally:
                with suppress(Exception):
                    if previous:
                        client.set_experiment_tag(store.experiment_id, GOOD_RUN_TAG, previous)
                with suppress(Exception):
                    if new != previous:
                        client.set_tag(new, N.GOOD, "false")
                with suppress(Exception):
                    if previous and previous != new:
                        client.set_tag(previous, N.GOOD, "true")
            raise

    def _good_run_id(self) -> str | None:
        return self.store.client.get_experiment(self.store.experiment_id).tags.get(GOOD_RUN_TAG) or None

    def _good_policy(self, run_id: str) -> GoodPolicy:
        from mlflow.exceptions import MlflowException

        where = f"experiment {self.store.experiment!r}: good run {run_id}"
        try:
            run = self.store.client.get_run(run_id)
        except MlflowException as err:
            raise TrackingError(f"{where} does not exist ({err.error_code})") from None
        policy = _run_policy(self.store, run_id)
        if policy is None:
            raise TrackingError(f"{where} has no {POLICY_ARTIFACT} artifact")
        m, recorded = run.data.metrics, run.data.tags.get(N.FINGERPRINT)
        if recorded and policy.fingerprint() != recorded:
            # The plugin's "mlflow:" loader checks the same: an edited artifact is a policy nobody measured.
            raise TrackingError(
                f"{where}: artifact {POLICY_ARTIFACT!r} has fingerprint {policy.fingerprint()}, but the run recorded "
                f"{recorded} (tag {N.FINGERPRINT}); the artifact was changed after the run logged it, so it is not "
                f"restored and the policy file is left as it is. Put the artifact back, or run `recompute-tune "
                f"RECIPE` to measure and promote a policy again"
            )
        at, peak = run.data.tags.get(N.PROMOTED_AT), finite(m.get("measured_peak_bytes"))
        return GoodPolicy(
            run_id=run_id,
            policy=policy,
            fingerprint=policy.fingerprint(),
            throughput=m.get("measured_throughput"),
            peak_bytes=None if peak is None else int(peak),
            promoted_at=datetime.fromisoformat(at) if at else None,
            micro_batch=_tag_int(run.data.params.get(N.MICRO_BATCH_PARAM)),
        )

    def _good_stack(self) -> list[str]:
        """Good run ids, oldest first, as the completed decisions leave them (promote pushes, rollback pops)."""
        stack: list[str] = []
        for d in self.history():
            if d.kind is DecisionKind.PROMOTE and d.new_good_run_id:
                stack.append(d.new_good_run_id)
            elif d.kind is DecisionKind.ROLLBACK and stack:
                stack.pop()
        return stack


def _run_policy(store: TrackingClient, run_id: str) -> RecomputePolicy | None:
    if POLICY_ARTIFACT not in {f.path for f in store.client.list_artifacts(run_id)}:
        return None
    with tempfile.TemporaryDirectory(prefix="recompute-policy-") as tmp:
        return RecomputePolicy.load(store.client.download_artifacts(run_id, POLICY_ARTIFACT, tmp))


def _file_state(path: Path, good: RecomputePolicy) -> str | None:
    """What is wrong with the policy file at ``path`` for the good policy ``good``; ``None`` if nothing.
    Its ``tuned_for`` counts too: training jobs warn from it when they run at another batch size."""
    fingerprint = good.fingerprint()
    if not path.exists():
        return "was missing"
    try:
        held = RecomputePolicy.load(path)
    except (OSError, PolicyError) as err:
        return f"was not a readable policy ({clip_tag(str(err), 200)})"
    if held.fingerprint() != fingerprint:
        return f"held policy {held.fingerprint()}, not the good policy {fingerprint}"
    if held.tuned_for == good.tuned_for:
        return None
    mine, theirs = ({} if t is None else t.to_dict() for t in (held.tuned_for, good.tuned_for))
    changed = ", ".join(
        f"{key} {mine.get(key)!r} (the good run's: {theirs.get(key)!r})"
        for key in sorted(set(mine) | set(theirs))
        if mine.get(key) != theirs.get(key)
    )
    return f"held the good policy {fingerprint} with another tuned_for: {clip_tag(changed, 500)}"


def _decision_seq(tags: Mapping[str, str]) -> int:
    """A decision run's position in the history; 0 when its tag (editable in the UI) is not a number."""
    return _tag_int(tags.get(N.DECISION_SEQ)) or 0


def _tag_int(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None
