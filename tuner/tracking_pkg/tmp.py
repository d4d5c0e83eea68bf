"""MLflow records of tuning: session runs, trial runs, and the good-policy decisions.

Layout (one experiment per recipe; everything the tuner decides can be read back from MLflow):

- **session run** (tag ``recompute.kind=session``, ``recompute.study=<study>``): the recipe
  (``recipe.yaml`` + its settings as ``recipe.*`` params), and at the end the best policy
  (``best_policy.yaml``, ``best.json``), the trials table (``trials.json``, ``trials.csv``),
  the baselines (``baselines.json``) and the Pareto plot (``pareto.png``); a markdown summary as
  the run's description.
- **trial run**, nested in the session (``recompute.kind=trial``, ``recompute.outcome=<outcome>``):
  one ``layer.<path>`` param per layer (its mode), ``micro_batch``, ``policy_fingerprint``,
  ``trial_number``; ``measured_*`` and ``predicted_*`` metrics; ``policy.yaml``.
- **confirmation run** (``recompute.kind=confirmation``): the evidence gate's long run, same shape.
- **decision run** (``recompute.kind=decision``, ``recompute.decision=promote|reject|rollback``):
  ``recompute.reason``, ``recompute.previous_good_run_id``, ``recompute.new_good_run_id``,
  ``recompute.decision_seq``; artifacts ``policy.yaml`` and ``evidence.json``.
- the **experiment tag** ``recompute.good_run_id`` names the run holding the current good policy
  (what `lightning_recompute.mlflow_policy.load_good_policy` reads); that run carries
  ``recompute.good=true``.

Every call names its run by id through `mlflow.MlflowClient`; nothing uses MLflow's global
active run, so a resumed session, a gate run after it, and several workers in one process or many
do not step on each other.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, fields, is_dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import yaml

from lightning_recompute.atomic import atomic_write
from lightning_recompute.errors import RecomputeError
from lightning_recompute.mlflow_policy import GOOD_RUN_TAG, POLICY_ARTIFACT
from lightning_recompute.policy import RecomputePolicy
from tuner.units import format_bytes as _format_bytes

if TYPE_CHECKING:
    from mlflow import MlflowClient

__all__ = [
    "DEFAULT_TRACKING_URI",
    "Decision",
    "GoodPolicy",
    "Tracker",
    "TrackingError",
    "artifact_location_for",
    "format_bytes",
    "jsonable",
    "trial_row",
]

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
"""Where runs go unless the recipe says otherwise (MLflow 3 deprecates the file store)."""

# Tag keys (the contract with search/session/cli and with people filtering in `mlflow ui`).
KIND = "recompute.kind"
STUDY = "recompute.study"
OUTCOME = "recompute.outcome"
REASON = "recompute.reason"
ERROR = "recompute.error"
DECISION = "recompute.decision"
DECISION_SEQ = "recompute.decision_seq"
PREVIOUS_GOOD = "recompute.previous_good_run_id"
NEW_GOOD = "recompute.new_good_run_id"
SOURCE_RUN = "recompute.source_run_id"
GOOD = "recompute.good"
PROMOTED_AT = "recompute.promoted_at"
FINGERPRINT = "recompute.policy_fingerprint"
POLICY_SHORT = "recompute.policy_short"
PARENT = "mlflow.parentRunId"
NOTE = "mlflow.note.content"

_STATUSES = {
    "finished": "FINISHED",
    "ok": "FINISHED",
    "completed": "FINISHED",
    "killed": "KILLED",
    "interrupted": "KILLED",
    "failed": "FAILED",
    "error": "FAILED",
}
# Trial outcomes that mean the trial itself broke; their runs end FAILED so the UI shows them red.
_FAILED_OUTCOMES = ("oom", "timeout", "error")
_BAD_NAME_CHARS = re.compile(r"[^/\w.\- :]")
_MAX_TAG = 5000  # below MLflow's 8000-character tag limit, with room for a multi-byte encoding


class TrackingError(RecomputeError):
    """The MLflow record cannot do what was asked (no session, nothing to roll back to, an inconsistent record)."""


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
    kind: Literal["promote", "reject", "rollback"]
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


def artifact_location_for(tracking_uri: str, experiment: str) -> str | None:
    """Where a new experiment keeps artifacts: ``<db folder>/mlartifacts/<experiment>`` for sqlite.

    A sqlite store has no folder of its own, and MLflow's default would be ``./mlartifacts`` in
    whatever directory the tuner (or a test) runs from. ``None`` leaves the choice to the store
    (a tracking server, a file store).
    """
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db = tracking_uri[len("sqlite:///") :]
    if not db or db == ":memory:":
        return None
    safe = re.sub(r"[^\w.\-]+", "_", experiment).strip("._") or "experiment"
    return str(Path(db).resolve().parent / "mlartifacts" / safe)


def _param_key(name: str) -> str:
    # MLflow rejects brackets, '*', '?' etc. in keys; layer paths rarely have them, patterns do.
    return _BAD_NAME_CHARS.sub("_", name)[:250]


def _clip(text: Any, limit: int = _MAX_TAG) -> str:
    s = str(text)
    return s if len(s) <= limit else s[: limit - 15] + " ...[truncated]"


def _now_ms() -> int:
    return int(time.time() * 1000)


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def _status(status: str) -> str:
    s = str(status).strip()
    if s.upper() in ("FINISHED", "KILLED", "FAILED"):
        return s.upper()
    try:
        return _STATUSES[s.lower()]
    except KeyError:
        valid = ", ".join(["FINISHED", "KILLED", "FAILED", *sorted(_STATUSES)])
        raise TrackingError(f"status: {status!r} is not a run status (valid: {valid})") from None


def jsonable(value: Any) -> Any:
    """A JSON-ready copy of results, policies, paths, dataclasses and mappings (non-finite floats become null)."""
    if isinstance(value, RecomputePolicy):
        return value.to_dict()
    if hasattr(value, "to_dict") and callable(value.to_dict):
        return jsonable(value.to_dict())
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def _result_dict(result: Any) -> dict[str, Any]:
    """A TrialResult (or anything with its field names) as a mapping."""
    d = jsonable(result)
    if not isinstance(d, dict) or "outcome" not in d:
        raise TrackingError(f"result: expected a TrialResult with an 'outcome', got {type(result).__name__}")
    return d


def _modes(policy: RecomputePolicy, layer_names: Sequence[str] | None) -> dict[str, str]:
    """Per-layer modes (or, without layer names, the policy's own pattern -> mode entries)."""
    if layer_names:
        return {name: policy.mode_for(name).value for name in layer_names}
    return {pattern: mode.value for pattern, mode in policy.layers}


def trial_row(
    number: int | None,
    policy: RecomputePolicy,
    layer_names: Sequence[str] | None,
    micro_batch: int | None,
    result: Any,
    prediction: Mapping[str, Any] | None = None,
    reason: str | None = None,
    run_id: str | None = None,
) -> dict[str, Any]:
    """One row of the trials table (`Tracker.finish_session`, the Pareto plot, ``trials.csv``).

    Keys: number, outcome, peak_bytes, throughput, throughput_unit, step_time_s, micro_batch,
    policy (one glyph per layer when ``layer_names`` is given), fingerprint, predicted_* (each
    numeric prediction), reason, error, run_id.
    """
    r = _result_dict(result)
    row: dict[str, Any] = {
        "number": number,
        "outcome": r.get("outcome"),
        "peak_bytes": r.get("peak_bytes"),
        "throughput": r.get("throughput"),
        "throughput_unit": r.get("throughput_unit"),
        "step_time_s": r.get("step_time_s"),
        "micro_batch": micro_batch,
        "policy": policy.short(layer_names) if layer_names else json.dumps(_modes(policy, None)),
        "fingerprint": policy.fingerprint(),
    }
    for key, value in (prediction or {}).items():
        if _finite(value) is not None:
            row[f"predicted_{key}"] = value
    row["reason"] = reason
    row["error"] = r.get("error")
    row["run_id"] = run_id
    return row


class Tracker:
    """MLflow bookkeeping of tuning sessions and of the experiment's good policy.

    Use it as a context manager (or `session`) so the session run always ends: FINISHED on a
    normal exit, KILLED on Ctrl-C, FAILED on an exception, and never stays RUNNING::

        with Tracker(recipe.tracking.uri, recipe.tracking.experiment) as tracker:
            tracker.start_session(recipe, study_name=study.study_name)
            tracker.log_trial(0, policy, names, None, result)
            tracker.finish_session(status="FINISHED", best=..., trials_table=None, baselines={}, budget_bytes=limit)

    Args:
        tracking_uri: the MLflow tracking URI (``sqlite:///mlflow.db`` by default in recipes).
        experiment: the experiment name (one per recipe); created when missing, with artifacts
            under the sqlite database's folder (`artifact_location_for`).
        artifact_location: overrides where a newly created experiment keeps artifacts.
    """

    def __init__(self, tracking_uri: str | None, experiment: str, *, artifact_location: str | None = None) -> None:
        import mlflow

        if not isinstance(experiment, str) or not experiment.strip():
            raise TrackingError(f"experiment: must be a non-empty name, got {experiment!r}")
        self.tracking_uri = tracking_uri or DEFAULT_TRACKING_URI
        self.experiment = experiment
        self.client: MlflowClient = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        self.experiment_id = self._experiment_id(artifact_location)
        self._session_run_id: str | None = None
        self._session_open = False
        self._study: str | None = None

    # ------------------------------------------------------------------ session lifecycle

    @property
    def session_run_id(self) -> str | None:
        """The current session run (``None`` before `start_session`)."""
        return self._session_run_id

    def start_session(self, recipe: Any, *, study_name: str, resume: bool = True) -> str:
        """Open the session run for ``study_name``; its run id.

        With ``resume``, the most recent session run of the same study is reused when it was
        interrupted (KILLED after Ctrl-C, FAILED after a crash), so one study keeps one session run
        however often it is resumed; its status is set back to RUNNING. A session run that is
        still RUNNING belongs to another worker on the same study, and this one gets its own.
        """
        from mlflow.entities import Param

        if self._session_open:
            raise TrackingError(f"a session is already open in this tracker (run {self._session_run_id})")
        run_id = self._resumable_session(study_name) if resume else None
        if run_id is not None:
            run = self.client.get_run(run_id)
            resumes = int(run.data.tags.get("recompute.resumes", "0")) + 1
            self.client.update_run(run_id, status="RUNNING")
            self.client.set_tag(run_id, "recompute.resumes", str(resumes))
        else:
            run = self.client.create_run(
                self.experiment_id,
                run_name=f"session {study_name}",
                tags={KIND: "session", STUDY: study_name},
            )
            run_id = run.info.run_id
            run = self.client.get_run(run_id)
        self._session_run_id, self._session_open, self._study = run_id, True, study_name

        params = self._recipe_params(recipe, study_name)
        logged = run.data.params
        # Params are write-once in MLflow; on resume log only new ones and name what changed
        # (e.g. n_trials extended) in a tag instead of failing the resumed session.
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        self._log_batch(run_id, params=new)
        if changed:
            self.client.set_tag(run_id, "recompute.recipe_changed_on_resume", _clip(", ".join(changed)))
        tags = {"recompute.recipe_name": str(getattr(recipe, "name", ""))}
        fingerprint = getattr(recipe, "fingerprint", None)
        if callable(fingerprint):
            tags["recompute.recipe_fingerprint"] = str(fingerprint())
        self._set_tags(run_id, tags)
        to_dict = getattr(recipe, "to_dict", None)
        if callable(to_dict):
            self.client.log_text(run_id, yaml.safe_dump(jsonable(to_dict()), sort_keys=False), "recipe.yaml")
        return run_id

    def log_trial(
        self,
        number: int,
        policy: RecomputePolicy,
        layer_names: Sequence[str] | None,
        micro_batch: int | None,
        result: Any,
        prediction: Mapping[str, Any] | None = None,
        reason: str | None = None,
    ) -> str:
        """Record one trial as a finished run nested in the session; its run id.

        Args:
            number: the Optuna trial number.
            policy: the policy the trial ran.
            layer_names: the model's layers (one ``layer.<path>`` param each); ``None`` logs the
                policy's own pattern entries instead.
            micro_batch: the micro-batch size (``None``: the data module's own).
            result: the `tuner.trial.TrialResult`.
            prediction: the planner's prediction; every numeric entry becomes a ``predicted_<key>``
                metric (``peak_bytes``, ``step_time_s``...).
            reason: why the trial ended as it did, when the caller knows better than the result
                (a planner skip, an Optuna constraint).
        """
        session = self._require_session()
        return self._log_measurement(
            kind="trial",
            run_name=f"trial {number} {policy.short(layer_names) if layer_names else policy.fingerprint()}",
            parent=session,
            policy=policy,
            layer_names=layer_names,
            micro_batch=micro_batch,
            result=result,
            prediction=prediction,
            reason=reason,
            extra_params={"trial_number": str(number)},
        )

    def log_confirmation(
        self,
        policy: RecomputePolicy,
        layer_names: Sequence[str] | None,
        micro_batch: int | None,
        result: Any,
        *,
        source_run_id: str | None = None,
        evidence: Mapping[str, Any] | None = None,
    ) -> str:
        """Record the evidence gate's confirmation run (nested in the session when one is open); its id.

        The run has the trial runs' shape (params, metrics, ``policy.yaml``) plus ``evidence.json``,
        so a promoted confirmation run is a self-contained good run.
        """
        run_id = self._log_measurement(
            kind="confirmation",
            run_name=f"confirm {policy.short(layer_names) if layer_names else policy.fingerprint()}",
            parent=self._session_run_id if self._session_open else None,
            policy=policy,
            layer_names=layer_names,
            micro_batch=micro_batch,
            result=result,
            prediction=None,
            reason=None,
            extra_params={},
            extra_tags={SOURCE_RUN: source_run_id} if source_run_id else None,
            evidence=evidence,
        )
        return run_id

    def trials_table(self, session_run_id: str | None = None) -> list[dict[str, Any]]:
        """The session's trials, read back from MLflow (so a resumed session sees earlier ones), by number."""
        session = session_run_id or self._require_session()
        runs = self._search(f"tags.`{PARENT}` = '{session}' and tags.`{KIND}` = 'trial'")
        rows = []
        for run in runs:
            p, m, t = run.data.params, run.data.metrics, run.data.tags
            mb = p.get("micro_batch")
            row: dict[str, Any] = {
                "number": int(p["trial_number"]) if p.get("trial_number", "").lstrip("-").isdigit() else None,
                "outcome": t.get(OUTCOME),
                "peak_bytes": _int_or_none(m.get("measured_peak_bytes")),
                "throughput": m.get("measured_throughput"),
                "throughput_unit": t.get("recompute.throughput_unit"),
                "step_time_s": m.get("measured_step_time_s"),
                "micro_batch": int(mb) if mb and mb.isdigit() else None,
                "policy": t.get(POLICY_SHORT),
                "fingerprint": p.get("policy_fingerprint"),
            }
            row.update({k: v for k, v in sorted(m.items()) if k.startswith("predicted_")})
            row["reason"] = t.get(REASON)
            row["error"] = t.get(ERROR)
            row["run_id"] = run.info.run_id
            rows.append(row)
        rows.sort(key=lambda r: (r["number"] is None, r["number"] if r["number"] is not None else 0))
        return rows

    def finish_session(
        self,
        *,
        status: str,
        best: Mapping[str, Any] | None,
        trials_table: Sequence[Mapping[str, Any]] | None,
        baselines: Mapping[str, Mapping[str, Any]],
        budget_bytes: int | None,
    ) -> None:
        """Write the session's summary artifacts and end its run with ``status``.

        Args:
            status: FINISHED, KILLED or FAILED (also: finished/ok, interrupted/killed, failed/error).
            best: the best trial, or ``None`` when nothing was feasible: a mapping with ``policy``
                (a `RecomputePolicy` or its dict) and any of ``run_id``, ``number``, ``throughput``,
                ``peak_bytes``, ``micro_batch``. Logged as ``best_policy.yaml`` and ``best.json``.
            trials_table: rows as `trial_row` builds them; ``None`` reads them back from MLflow
                (`trials_table`), which includes trials logged before a resume.
            baselines: name -> row (``none``, ``full``...) drawn and labelled on the Pareto plot.
            budget_bytes: the memory limit (after the margin), drawn on the plot.
        """
        run_id = self._require_session()
        final = _status(status)
        rows = [dict(r) for r in (self.trials_table(run_id) if trials_table is None else trials_table)]
        try:
            self._log_json(run_id, "trials.json", rows)
            self.client.log_text(run_id, _csv(rows), "trials.csv")
            self._log_json(run_id, "baselines.json", baselines)
            with tempfile.TemporaryDirectory(prefix="recompute-plot-") as tmp:
                from tuner.plots import pareto_plot

                png = pareto_plot(
                    rows,
                    Path(tmp) / "pareto.png",
                    baselines=baselines,
                    budget_bytes=budget_bytes,
                    title=f"{self.experiment}: peak memory vs throughput",
                )
                self.client.log_artifact(run_id, str(png))
            metrics = {
                "trials_total": len(rows),
                "trials_ok": sum(1 for r in rows if r.get("outcome") == "ok"),
            }
            if budget_bytes is not None:
                metrics["budget_limit_bytes"] = budget_bytes
            tags = {"recompute.session_status": final}
            if best is not None:
                policy = best.get("policy")
                if policy is not None:
                    policy = policy if isinstance(policy, RecomputePolicy) else RecomputePolicy.from_dict(policy)
                    self.client.log_text(run_id, policy.to_yaml(), "best_policy.yaml")
                    tags["recompute.best_fingerprint"] = policy.fingerprint()
                self._log_json(run_id, "best.json", best)
                if best.get("run_id"):
                    tags["recompute.best_run_id"] = str(best["run_id"])
                for key in ("throughput", "peak_bytes"):
                    if _finite(best.get(key)) is not None:
                        metrics[f"best_{key}"] = float(best[key])
            self._log_batch(run_id, metrics=metrics)
            tags[NOTE] = _clip(self._summary(final, best, rows, baselines, budget_bytes))
            self._set_tags(run_id, tags)
        finally:
            # Whatever failed above, the run must not stay RUNNING.
            self.close(final)

    def close(self, status: str = "KILLED") -> None:
        """End the session run (and any run nested in it still RUNNING) with ``status``; idempotent."""
        if not self._session_open or self._session_run_id is None:
            return
        final = _status(status)
        run_id = self._session_run_id
        self._session_open = False
        try:
            for child in self._search(f"tags.`{PARENT}` = '{run_id}' and attributes.status = 'RUNNING'"):
                self.client.set_terminated(child.info.run_id, final)
        finally:
            self.client.set_terminated(run_id, final)

    @contextmanager
    def session(self, recipe: Any, *, study_name: str, resume: bool = True) -> Iterator[str]:
        """`start_session` ... `close`: FINISHED, KILLED on Ctrl-C, FAILED on any other exception."""
        run_id = self.start_session(recipe, study_name=study_name, resume=resume)
        try:
            yield run_id
        except KeyboardInterrupt:
            self.close("KILLED")
            raise
        except BaseException:
            self.close("FAILED")
            raise
        self.close("FINISHED")

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close("FINISHED")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.close("KILLED")
        else:
            self.close("FAILED")

    # ------------------------------------------------------------------ the good policy

    def current_good(self) -> GoodPolicy | None:
        """The experiment's current good policy, or ``None`` before the first promotion."""
        exp = self.client.get_experiment(self.experiment_id)
        run_id = exp.tags.get(GOOD_RUN_TAG)
        return self._good_policy(run_id) if run_id else None

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
        decision_id = self._start_decision(
            "promote", policy, reason=reason, evidence=evidence, previous=previous, source_run_id=source_run_id
        )
        good_run = good_run or decision_id
        self._finish_decision(decision_id, policy, output_path, previous=previous, new=good_run, rolled_back=False)
        return decision_id

    def reject(
        self, policy: RecomputePolicy, *, source_run_id: str | None, reason: str, evidence: Mapping[str, Any]
    ) -> str:
        """Record that ``policy`` failed the gate, and why; the good policy and its file stay. The decision run id."""
        previous = self._good_run_id()
        decision_id = self._start_decision(
            "reject", policy, reason=reason, evidence=evidence, previous=previous, source_run_id=source_run_id
        )
        self.client.set_tag(decision_id, NEW_GOOD, previous or "")
        if source_run_id is not None:
            self._set_tags(source_run_id, {"recompute.rejected": "true", "recompute.reject_reason": _clip(reason)})
        self.client.set_terminated(decision_id, "FINISHED")
        return decision_id

    def rollback(self, *, output_path: str | Path) -> GoodPolicy:
        """Restore the good policy before the current one (file and MLflow record); the restored one.

        Rollbacks stack: promote A, promote B, promote C, rollback, rollback leaves A.

        Raises:
            TrackingError: there is no earlier good policy, or the experiment's good-run tag no
                longer matches the recorded history (someone edited it by hand).
        """
        current = self._good_run_id()
        stack = self._good_stack()
        if current is None or len(stack) < 2:
            have = "no good policy at all" if current is None else f"only the first good policy (run {current})"
            raise TrackingError(
                f"experiment {self.experiment!r}: nothing to roll back to; it has {have}. "
                f"`recompute-tune history` lists the decisions."
            )
        if stack[-1] != current:
            raise TrackingError(
                f"experiment {self.experiment!r}: tag {GOOD_RUN_TAG} is {current}, but the decision history "
                f"ends at {stack[-1]}; the tag was changed outside the tuner. Set it back or promote again."
            )
        target = stack[-2]
        restored = self._good_policy(target)
        decision_id = self._start_decision(
            "rollback",
            restored.policy,
            reason=f"rolled back from run {current} to run {target}",
            evidence={"rolled_back_run_id": current, "restored_run_id": target},
            previous=current,
            source_run_id=target,
        )
        self._finish_decision(decision_id, restored.policy, output_path, previous=current, new=target, rolled_back=True)
        return self._good_policy(target)

    def history(self) -> list[Decision]:
        """Every completed promotion, rejection and rollback of the experiment, oldest first."""
        out = []
        for run in self._decision_runs():
            t = run.data.tags
            out.append(
                Decision(
                    run_id=run.info.run_id,
                    kind=t[DECISION],  # type: ignore[arg-type]
                    seq=int(t.get(DECISION_SEQ, "0")),
                    at=datetime.fromtimestamp(run.info.start_time / 1000, tz=timezone.utc),
                    reason=t.get(REASON, ""),
                    fingerprint=t.get(FINGERPRINT),
                    previous_good_run_id=t.get(PREVIOUS_GOOD) or None,
                    new_good_run_id=t.get(NEW_GOOD) or None,
                    source_run_id=t.get(SOURCE_RUN) or None,
                )
            )
        return out

    # ------------------------------------------------------------------ internals

    def _experiment_id(self, artifact_location: str | None) -> str:
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is None:
            location = artifact_location or artifact_location_for(self.tracking_uri, self.experiment)
            try:
                return self.client.create_experiment(self.experiment, artifact_location=location)
            except MlflowException as err:
                # Another worker created it between our lookup and create: use theirs.
                exp = self.client.get_experiment_by_name(self.experiment)
                if exp is None:
                    raise TrackingError(f"cannot create MLflow experiment {self.experiment!r}: {err}") from err
        if exp.lifecycle_stage != "active":
            raise TrackingError(
                f"MLflow experiment {self.experiment!r} is deleted; restore it (`mlflow experiments restore "
                f"--experiment-id {exp.experiment_id}`) or set tracking.experiment to another name"
            )
        return exp.experiment_id

    def _require_session(self) -> str:
        if not self._session_open or self._session_run_id is None:
            raise TrackingError("no open session: call start_session() (or use Tracker.session()) first")
        return self._session_run_id

    def _search(self, filter_string: str) -> list[Any]:
        from mlflow.entities import ViewType

        runs: list[Any] = []
        token = None
        while True:
            page = self.client.search_runs(
                [self.experiment_id],
                filter_string=filter_string,
                run_view_type=ViewType.ACTIVE_ONLY,
                max_results=1000,
                page_token=token,
            )
            runs.extend(page)
            token = page.token
            if not token:
                return runs

    def _resumable_session(self, study_name: str) -> str | None:
        quoted = study_name.replace("'", "\\'")
        runs = self._search(f"tags.`{KIND}` = 'session' and tags.`{STUDY}` = '{quoted}'")
        if not runs:
            return None
        latest = max(runs, key=lambda r: r.info.start_time)
        # Only an interrupted (KILLED) or crashed (FAILED) session is picked up again. A RUNNING
        # one belongs to a worker that is still tuning the same study: sharing its run would let
        # whichever worker finishes first close it under the other's trials, so this worker
        # opens a session run of its own.
        return latest.info.run_id if latest.info.status in ("KILLED", "FAILED") else None

    def _recipe_params(self, recipe: Any, study_name: str) -> dict[str, str]:
        params = {"study_name": study_name}
        to_dict = getattr(recipe, "to_dict", None)
        data = jsonable(to_dict()) if callable(to_dict) else {}
        # Locations (tracking, study storage, output) are tags-worthy at most: they move with a
        # checkout and are not what a trial measured.
        for key, value in _flatten(data, "recipe").items():
            if key.split(".")[1] in ("tracking", "study", "output"):
                continue
            params[_param_key(key)] = _clip(value, 500)
        return params

    def _log_batch(
        self,
        run_id: str,
        *,
        params: Sequence[Any] = (),
        metrics: Mapping[str, float] | None = None,
        tags: Mapping[str, str] | None = None,
        step: int = 0,
    ) -> None:
        from mlflow.entities import Metric, RunTag

        ts = _now_ms()
        ms = [Metric(_param_key(k), float(v), ts, step) for k, v in (metrics or {}).items()]
        ts_list = [RunTag(k, _clip(v)) for k, v in (tags or {}).items()]
        params = list(params)
        # MLflow caps a batch at 100 params/tags and 1000 metrics (a 126-layer model has more).
        for i in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[i : i + 100])
        for i in range(0, len(ts_list), 100):
            self.client.log_batch(run_id, tags=ts_list[i : i + 100])
        for i in range(0, len(ms), 1000):
            self.client.log_batch(run_id, metrics=ms[i : i + 1000])

    def _set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        self._log_batch(run_id, tags=tags)

    def _log_json(self, run_id: str, name: str, data: Any) -> None:
        self.client.log_text(run_id, json.dumps(jsonable(data), indent=2, allow_nan=False), name)

    def _log_measurement(
        self,
        *,
        kind: str,
        run_name: str,
        parent: str | None,
        policy: RecomputePolicy,
        layer_names: Sequence[str] | None,
        micro_batch: int | None,
        result: Any,
        prediction: Mapping[str, Any] | None,
        reason: str | None,
        extra_params: Mapping[str, str],
        extra_tags: Mapping[str, str] | None = None,
        evidence: Mapping[str, Any] | None = None,
    ) -> str:
        from mlflow.entities import Metric, Param

        r = _result_dict(result)
        outcome = str(r["outcome"])
        wall = _finite(r.get("wall_s")) or 0.0
        tags = {KIND: kind, OUTCOME: outcome, FINGERPRINT: policy.fingerprint()}
        if parent is not None:
            tags[PARENT] = parent
            if self._study:
                tags[STUDY] = self._study
        if layer_names:
            tags[POLICY_SHORT] = policy.short(layer_names)
        for key, tag in (("device", "recompute.device"), ("throughput_unit", "recompute.throughput_unit")):
            if r.get(key):
                tags[tag] = str(r[key])
        if reason or r.get("error"):
            tags[REASON] = _clip(reason or r["error"])
        if r.get("error"):
            tags[ERROR] = _clip(r["error"])
        tags.update(extra_tags or {})
        # The run's span in the UI is the trial's own wall time, not the time it took to log it.
        end = _now_ms()
        run = self.client.create_run(
            self.experiment_id, start_time=end - int(wall * 1000), tags=tags, run_name=run_name
        )
        run_id = run.info.run_id
        status = "FAILED" if outcome in _FAILED_OUTCOMES else "FINISHED"
        try:
            params = [Param(_param_key(f"layer.{name}"), mode) for name, mode in _modes(policy, layer_names).items()]
            params += [
                Param("micro_batch", "default" if micro_batch is None else str(micro_batch)),
                Param("policy_fingerprint", policy.fingerprint()),
                *(Param(k, v) for k, v in extra_params.items()),
            ]
            metrics: dict[str, float] = {}
            for key in ("peak_bytes", "throughput", "step_time_s", "samples_per_s", "tokens_per_s"):
                v = _finite(r.get(key))
                if v is not None:
                    metrics[f"measured_{key}"] = v
            if wall:
                metrics["wall_s"] = wall
            if _finite(r.get("device_total_bytes")) is not None:
                metrics["device_total_bytes"] = float(r["device_total_bytes"])
            for key, value in (prediction or {}).items():
                if _finite(value) is not None:
                    metrics[f"predicted_{key}"] = float(value)
            self._log_batch(run_id, params=params, metrics=metrics)
            steps = [
                Metric("step_time_s", float(s), end, i)
                for i, s in enumerate(r.get("step_times_s") or [])
                if _finite(s) is not None
            ]
            for i in range(0, len(steps), 1000):
                self.client.log_batch(run_id, metrics=steps[i : i + 1000])
            self.client.log_text(run_id, policy.to_yaml(), POLICY_ARTIFACT)
            if r.get("stderr_tail"):
                self.client.log_text(run_id, str(r["stderr_tail"]), "stderr_tail.txt")
            if evidence is not None:
                self._log_json(run_id, "evidence.json", evidence)
        except BaseException:
            status = "FAILED"
            raise
        finally:
            self.client.set_terminated(run_id, status)
        return run_id

    def _good_run_id(self) -> str | None:
        return self.client.get_experiment(self.experiment_id).tags.get(GOOD_RUN_TAG) or None

    def _run_policy(self, run_id: str) -> RecomputePolicy | None:
        """The ``policy.yaml`` of a run, or ``None`` when it has none."""
        names = {f.path for f in self.client.list_artifacts(run_id)}
        if POLICY_ARTIFACT not in names:
            return None
        with tempfile.TemporaryDirectory(prefix="recompute-policy-") as tmp:
            local = self.client.download_artifacts(run_id, POLICY_ARTIFACT, tmp)
            return RecomputePolicy.load(local)

    def _ensure_run_policy(self, run_id: str, policy: RecomputePolicy) -> None:
        held = self._run_policy(run_id)
        if held is None:
            # A run logged by other means (a hand-made run, an older tuner): give it the artifact
            # the plugin's loader reads.
            self.client.log_text(run_id, policy.to_yaml(), POLICY_ARTIFACT)
        elif held.fingerprint() != policy.fingerprint():
            raise TrackingError(
                f"run {run_id} measured policy {held.fingerprint()}, not the promoted {policy.fingerprint()}; "
                f"promote the policy together with the run that measured it"
            )

    def _good_policy(self, run_id: str) -> GoodPolicy:
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException as err:
            raise TrackingError(
                f"experiment {self.experiment!r}: good run {run_id} does not exist ({err.error_code})"
            ) from None
        policy = self._run_policy(run_id)
        if policy is None:
            raise TrackingError(f"experiment {self.experiment!r}: good run {run_id} has no {POLICY_ARTIFACT} artifact")
        m, p, t = run.data.metrics, run.data.params, run.data.tags
        at = t.get(PROMOTED_AT)
        mb = p.get("micro_batch")
        return GoodPolicy(
            run_id=run_id,
            policy=policy,
            fingerprint=policy.fingerprint(),
            throughput=m.get("measured_throughput"),
            peak_bytes=_int_or_none(m.get("measured_peak_bytes")),
            promoted_at=datetime.fromisoformat(at) if at else None,
            micro_batch=int(mb) if mb and mb.isdigit() else None,
        )

    def _decision_runs(self) -> list[Any]:
        runs = self._search(f"tags.`{KIND}` = 'decision' and attributes.status = 'FINISHED'")
        return sorted(runs, key=lambda r: (int(r.data.tags.get(DECISION_SEQ, "0")), r.info.start_time))

    def _good_stack(self) -> list[str]:
        """Good run ids, oldest first, as the completed decisions leave them (promote pushes, rollback pops)."""
        stack: list[str] = []
        for run in self._decision_runs():
            t = run.data.tags
            if t.get(DECISION) == "promote" and t.get(NEW_GOOD):
                stack.append(t[NEW_GOOD])
            elif t.get(DECISION) == "rollback" and stack:
                stack.pop()
        return stack

    def _start_decision(
        self,
        kind: str,
        policy: RecomputePolicy,
        *,
        reason: str,
        evidence: Mapping[str, Any],
        previous: str | None,
        source_run_id: str | None,
    ) -> str:
        seq = 1 + max(
            (int(r.data.tags.get(DECISION_SEQ, "0")) for r in self._search(f"tags.`{KIND}` = 'decision'")), default=0
        )
        tags = {
            KIND: "decision",
            DECISION: kind,
            DECISION_SEQ: str(seq),
            REASON: _clip(reason),
            PREVIOUS_GOOD: previous or "",
            FINGERPRINT: policy.fingerprint(),
        }
        if source_run_id:
            tags[SOURCE_RUN] = source_run_id
        if self._session_open and self._session_run_id:
            tags[PARENT] = self._session_run_id
        run = self.client.create_run(self.experiment_id, tags=tags, run_name=f"{kind} {policy.fingerprint()}")
        run_id = run.info.run_id
        try:
            self.client.log_text(run_id, policy.to_yaml(), POLICY_ARTIFACT)
            self._log_json(run_id, "evidence.json", evidence)
        except BaseException:
            self.client.set_terminated(run_id, "FAILED")
            raise
        return run_id

    def _finish_decision(
        self,
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
            self.client.set_tag(decision_id, NEW_GOOD, new)
            policy.save(out)
            now = datetime.now(timezone.utc).isoformat()
            self._set_tags(new, {GOOD: "true", PROMOTED_AT: now, "recompute.promoted": "true"})
            if previous and previous != new:
                prev_tags = {GOOD: "false"}
                if rolled_back:
                    prev_tags["recompute.rolled_back"] = "true"
                self._set_tags(previous, prev_tags)
            self.client.set_experiment_tag(self.experiment_id, GOOD_RUN_TAG, new)
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
                        self.client.set_experiment_tag(self.experiment_id, GOOD_RUN_TAG, previous)
                with suppress(Exception):
                    if new != previous:
                        self.client.set_tag(new, GOOD, "false")
                with suppress(Exception):
                    if previous and previous != new:
                        self.client.set_tag(previous, GOOD, "true")
                with suppress(Exception):
                    self.client.set_terminated(decision_id, "FAILED")
            raise
        self.client.set_terminated(decision_id, "FINISHED")

    def _summary(
        self,
        status: str,
        best: Mapping[str, Any] | None,
        rows: Sequence[Mapping[str, Any]],
        baselines: Mapping[str, Mapping[str, Any]],
        budget_bytes: int | None,
    ) -> str:
        counts: dict[str, int] = {}
        for r in rows:
            counts[str(r.get("outcome"))] = counts.get(str(r.get("outcome")), 0) + 1
        lines = [f"**Tuning session {status.lower()}** for experiment `{self.experiment}`", ""]
        lines.append(f"- budget limit: {format_bytes(budget_bytes)}")
        lines.append(f"- trials: {len(rows)} (" + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + ")")
        if best is not None:
            lines.append(
                f"- best: trial {best.get('number', '?')}, throughput {best.get('throughput', '?')}, "
                f"peak {format_bytes(best.get('peak_bytes'))} (`best_policy.yaml`)"
            )
        else:
            lines.append("- best: none within the budget")
        for name, b in baselines.items():
            lines.append(
                f"- baseline {name}: throughput {b.get('throughput', '?')}, peak {format_bytes(b.get('peak_bytes'))}"
                + (f", {b['outcome']}" if b.get("outcome") else "")
            )
        lines += ["", "Artifacts: `pareto.png`, `trials.csv`, `trials.json`, `recipe.yaml`."]
        return "\n".join(lines)


def _int_or_none(value: Any) -> int | None:
    v = _finite(value)
    return None if v is None else int(v)


def format_bytes(value: Any) -> str:
    """``1.50 GiB``-style text; ``n/a`` for ``None``."""
    v = _finite(value)
    return "n/a" if v is None else _format_bytes(v)


def _flatten(data: Any, prefix: str) -> dict[str, str]:
    if isinstance(data, Mapping) and data:
        out: dict[str, str] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}.{k}"))
        return out
    if isinstance(data, (list, dict)):
        return {prefix: json.dumps(data)}
    return {prefix: "null" if data is None else str(data)}


def _csv(rows: Sequence[Mapping[str, Any]]) -> str:
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: _cell(r.get(k)) for k in columns})
    return buf.getvalue()


def _cell(value: Any) -> Any:
    # Nested values (a policy mapping) as JSON, so a spreadsheet cell can be parsed back.
    if value is None:
        return ""
    if isinstance(value, (Mapping, list, tuple)):
        return json.dumps(jsonable(value), separators=(",", ":"))
    return value
