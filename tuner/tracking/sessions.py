"""Session and trial runs: the session run of a study (resumed after an interruption), one nested
run per trial or confirmation, and the session's summary artifacts when it ends."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from lightning_recompute.mlflow_policy import POLICY_ARTIFACT
from lightning_recompute.policy import RecomputePolicy
from tuner.jsonable import jsonable
from tuner.tracking.client import (
    TrackingClient,
    TrackingError,
    clip_tag,
    finite,
    now_ms,
    param_key,
)
from tuner.tracking.names import (
    BASELINES_JSON,
    BEST_FINGERPRINT,
    BEST_JSON,
    BEST_POLICY_YAML,
    BEST_RUN,
    COMPILE_PARAM,
    COMPILE_SECONDS_METRIC,
    DEVICE,
    ERROR,
    EVIDENCE_JSON,
    FINGERPRINT,
    HEARTBEAT,
    IN_JOB,
    KIND,
    MACHINE_METRIC_PREFIX,
    MICRO_BATCH_PARAM,
    NOTE,
    OUTCOME,
    OWNER,
    PARENT,
    POLICY_FINGERPRINT_PARAM,
    POLICY_SHORT,
    RACE_JSON,
    RACE_SUMMARY,
    RACE_WINNER,
    REASON,
    RECIPE_CHANGED_ON_RESUME,
    RECIPE_FINGERPRINT,
    RECIPE_NAME,
    RECIPE_YAML,
    RESUMES,
    SESSION_ENDED_BY,
    SESSION_NOTES,
    SESSION_STATUS,
    SOURCE_RUN,
    STDERR_TAIL_TXT,
    STEP_NOISE_METRICS,
    STUDY,
    STUDY_NAME_PARAM,
    THROUGHPUT_UNIT,
    TRIAL_NUMBER_PARAM,
    TRIALS_CSV,
    TRIALS_JSON,
    rank_peak_metric,
)
from tuner.tracking.report import layer_modes, result_dict, session_markdown, trials_csv

if TYPE_CHECKING:
    from tuner.race import RaceResult
    from tuner.recipe import Recipe
    from tuner.trials import TrialResult


_S = TypeVar("_S", bound="SessionLog")


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
_FAILED_OUTCOMES = ("oom", "timeout", "error", "nonfinite")


class SessionLog:
    """The session run of one study and the runs nested in it, recorded through ``store``.

    Use it as a context manager (or `session`) so the session run always ends: FINISHED on a
    normal exit, KILLED on Ctrl-C, FAILED on an exception, and never stays RUNNING.

    Args:
        store: the experiment's client (shared with the `PolicyRegistry` of the same `Tracker`).
    """

    def __init__(self, store: TrackingClient) -> None:
        self.store = store
        self._session_run_id: str | None = None
        self._session_open = False
        self._study: str | None = None

    # ------------------------------------------------------------------ session lifecycle

    @property
    def session_run_id(self) -> str | None:
        """The current session run (``None`` before `start_session`)."""
        return self._session_run_id

    def start_session(self, recipe: Recipe, *, study_name: str, resume: bool = True) -> str:
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
            run = self.store.client.get_run(run_id)
            resumes = int(run.data.tags.get(RESUMES, "0")) + 1
            self.store.client.update_run(run_id, status="RUNNING")
            self.store.client.set_tag(run_id, RESUMES, str(resumes))
        else:
            run = self.store.client.create_run(
                self.store.experiment_id,
                run_name=f"session {study_name}",
                tags={KIND: "session", STUDY: study_name},
            )
            run_id = run.info.run_id
            run = self.store.client.get_run(run_id)
        self._session_run_id, self._session_open, self._study = run_id, True, study_name

        params = self._recipe_params(recipe, study_name)
        logged = run.data.params
        # Params are write-once in MLflow; on resume log only new ones and name what changed
        # (e.g. n_trials extended) in a tag instead of failing the resumed session.
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        self.store.log_batch(run_id, params=new)
        if changed:
            self.store.client.set_tag(run_id, RECIPE_CHANGED_ON_RESUME, clip_tag(", ".join(changed)))
        from tuner.liveness import Owner

        # Who runs this session, and a first heartbeat: another process ends the run KILLED once
        # this owner is dead (`end_dead_sessions`).
        tags = {
            RECIPE_NAME: str(getattr(recipe, "name", "")),
            OWNER: json.dumps(Owner.me().to_dict()),
            HEARTBEAT: repr(time.time()),
        }
        fingerprint = getattr(recipe, "fingerprint", None)
        if callable(fingerprint):
            tags[RECIPE_FINGERPRINT] = str(fingerprint())
        self.store.set_tags(run_id, tags)
        to_dict = getattr(recipe, "to_dict", None)
        if callable(to_dict):
            self.store.client.log_text(run_id, yaml.safe_dump(jsonable(to_dict()), sort_keys=False), RECIPE_YAML)
        return run_id

    def start_job_session(self, name: str, params: Mapping[str, str], *, parent_run_id: str | None = None) -> str:
        """Open the session run of a tuning inside a training job (`tuner.auto.AutoRecompute`); its run id.

        The layout is a tuning session's (trial runs nest in it, `log_race` and `finish_session` write
        the same records), without a recipe or a study: ``name`` stands for the study, ``params`` say
        what was tuned (budget, candidates, race plan), and the run nests under the job's own run
        (``parent_run_id``, e.g. its ``MLFlowLogger``'s) when there is one. Never resumed: a job that
        restarts from a checkpoint keeps its decision and does not tune again.
        """
        if self._session_open:
            raise TrackingError(f"a session is already open in this tracker (run {self._session_run_id})")
        from tuner.liveness import Owner

        tags = {KIND: "session", STUDY: name, IN_JOB: "true", OWNER: json.dumps(Owner.me().to_dict())}
        if parent_run_id is not None:
            tags[PARENT] = parent_run_id
        run = self.store.client.create_run(self.store.experiment_id, run_name=f"in-job {name}", tags=tags)
        run_id = run.info.run_id
        self._session_run_id, self._session_open, self._study = run_id, True, name
        from mlflow.entities import Param

        self.store.log_batch(run_id, params=[Param(param_key(k), clip_tag(v, 500)) for k, v in params.items()])
        return run_id

    def log_trial(
        self,
        number: int,
        policy: RecomputePolicy,
        layer_names: Sequence[str] | None,
        micro_batch: int | None,
        result: TrialResult,
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
            result: the `tuner.trials.TrialResult`.
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
            extra_params={TRIAL_NUMBER_PARAM: str(number)},
        )

    def beat(self) -> None:
        """The session run's heartbeat (the `tuner.liveness.Heartbeat` thread calls it)."""
        if self._session_open and self._session_run_id is not None:
            self.store.client.set_tag(self._session_run_id, HEARTBEAT, repr(time.time()))

    def log_abandoned_trial(
        self,
        number: int,
        policy: RecomputePolicy,
        layer_names: Sequence[str] | None,
        micro_batch: int | None,
        *,
        reason: str,
        session_run_id: str | None,
    ) -> str:
        """Record a trial whose owner died mid-trial: a FAILED run, outcome ``abandoned``, with why; its id.

        The run is nested in the dead owner's session run (``session_run_id``) when it had one,
        else in this session's, so the dead session's record holds what it was doing.
        """
        parent = session_run_id or self._require_session()
        tags = {
            KIND: "trial",
            OUTCOME: "abandoned",
            REASON: clip_tag(reason),
            ERROR: clip_tag(reason),
            FINGERPRINT: policy.fingerprint(),
            PARENT: parent,
        }
        if self._study:
            tags[STUDY] = self._study
        if layer_names:
            tags[POLICY_SHORT] = policy.short(layer_names)
        name = policy.short(layer_names) if layer_names else policy.fingerprint()
        run = self.store.client.create_run(self.store.experiment_id, tags=tags, run_name=f"trial {number} {name}")
        run_id = run.info.run_id
        try:
            from mlflow.entities import Param

            self.store.log_batch(
                run_id,
                params=[
                    Param(MICRO_BATCH_PARAM, "default" if micro_batch is None else str(micro_batch)),
                    Param(POLICY_FINGERPRINT_PARAM, policy.fingerprint()),
                    Param(TRIAL_NUMBER_PARAM, str(number)),
                ],
            )
        finally:
            self.store.client.set_terminated(run_id, "FAILED")
        return run_id

    def end_dead_sessions(self, study_name: str, grace_s: float) -> list[str]:
        """End KILLED every RUNNING session run of ``study_name`` whose owner is dead; their ids.

        Its nested runs still RUNNING end FAILED. A session run without an owner tag (an older
        version's) is judged by its start time against ``grace_s``, like another host's.
        """
        from tuner.liveness import Owner, dead_reason

        quoted = study_name.replace("'", "\\'")
        ended = []
        for run in self.store.search(
            f"tags.`{KIND}` = 'session' and tags.`{STUDY}` = '{quoted}' and attributes.status = 'RUNNING'"
        ):
            if run.info.run_id == self._session_run_id:
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
            self.store.client.set_tag(run_id, SESSION_ENDED_BY, clip_tag(why))
            for child in self.store.search(f"tags.`{PARENT}` = '{run_id}' and attributes.status = 'RUNNING'"):
                self.store.client.set_terminated(child.info.run_id, "FAILED")
            self.store.client.set_terminated(run_id, "KILLED")
            ended.append(run_id)
        return ended

    def log_confirmation(
        self,
        policy: RecomputePolicy,
        layer_names: Sequence[str] | None,
        micro_batch: int | None,
        result: TrialResult,
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

    def finish_session(
        self,
        *,
        status: str,
        best: Mapping[str, Any] | None,
        trials_table: Sequence[Mapping[str, Any]],
        baselines: Mapping[str, Mapping[str, Any]],
        budget_bytes: int | None,
    ) -> None:
        """Write the session's summary artifacts and end its run with ``status``.

        Args:
            status: FINISHED, KILLED or FAILED (also: finished/ok, interrupted/killed, failed/error).
            best: the best trial, or ``None`` when nothing was feasible: a mapping with ``policy``
                (a `RecomputePolicy` or its dict) and any of ``run_id``, ``number``, ``throughput``,
                ``peak_bytes``, ``micro_batch``. Logged as ``best_policy.yaml`` and ``best.json``.
            trials_table: rows as `tuner.search.TrialRecord.to_dict` builds them (the study's records,
                which cover trials logged before a resume and other workers' trials); logged as
                ``trials.json`` and ``trials.csv`` and drawn on the Pareto plot.
            baselines: name -> row (``none``, ``full``...) drawn and labelled on the Pareto plot.
            budget_bytes: the memory limit (after the margin), drawn on the plot.
        """
        run_id = self._require_session()
        final = _status(status)
        rows = [dict(r) for r in trials_table]
        try:
            self.store.log_json(run_id, TRIALS_JSON, rows)
            self.store.client.log_text(run_id, trials_csv(rows), TRIALS_CSV)
            self.store.log_json(run_id, BASELINES_JSON, baselines)
            with tempfile.TemporaryDirectory(prefix="recompute-plot-") as tmp:
                from tuner.plots import pareto_plot

                png = pareto_plot(
                    rows,
                    Path(tmp) / "pareto.png",
                    baselines=baselines,
                    budget_bytes=budget_bytes,
                    title=f"{self.store.experiment}: peak memory vs throughput",
                )
                self.store.client.log_artifact(run_id, str(png))
            metrics: dict[str, float] = {
                "trials_total": len(rows),
                "trials_ok": sum(1 for r in rows if r.get("outcome") == "ok"),
            }
            if budget_bytes is not None:
                metrics["budget_limit_bytes"] = budget_bytes
            tags = {SESSION_STATUS: final}
            if best is not None:
                policy = best.get("policy")
                if policy is not None:
                    policy = policy if isinstance(policy, RecomputePolicy) else RecomputePolicy.from_dict(policy)
                    self.store.client.log_text(run_id, policy.to_yaml(), BEST_POLICY_YAML)
                    tags[BEST_FINGERPRINT] = policy.fingerprint()
                self.store.log_json(run_id, BEST_JSON, best)
                if best.get("run_id"):
                    tags[BEST_RUN] = str(best["run_id"])
                for key in ("throughput", "peak_bytes"):
                    if finite(best.get(key)) is not None:
                        metrics[f"best_{key}"] = float(best[key])
            self.store.log_batch(run_id, metrics=metrics)
            tags[NOTE] = clip_tag(session_markdown(self.store.experiment, final, best, rows, baselines, budget_bytes))
            self.store.set_tags(run_id, tags)
        finally:
            # Whatever failed above, the run must not stay RUNNING.
            self.close(final)

    def log_race(self, race: RaceResult) -> None:
        """Record the race on the session run: ``race.json`` (every entrant's per-round times, the
        standing, the intervals), its winner and words as tags, its figures as metrics."""
        from tuner.race import format_gain

        run_id = self._require_session()
        self.store.log_json(run_id, RACE_JSON, race.to_dict())
        words = [f"race {race.outcome}" + (f": {race.reason}" if race.reason else "")]
        if race.ok:
            words.append(
                f"{race.select_rounds} selection rounds ({race.stop}), {race.estimate_rounds} estimation rounds"
            )
            words += [line for line in (race.tie_line(), race.unresolved_line(), *race.headlines()) if line]
        tags = {RACE_SUMMARY: clip_tag("; ".join(words))}
        metrics: dict[str, float] = {"race_wall_s": race.wall_s, "race_rounds": float(race.select_rounds)}
        if race.winner is not None:
            tags[RACE_WINNER] = race.winner
            thr = race.throughput(race.winner)
            if thr is not None:
                metrics["race_winner_throughput"] = thr
        for key, iv in race.vs.items():
            name = _metric_key(race.entrants[key].labels[-1] if race.entrants[key].labels else key)
            gain, low, high = iv.gain()
            metrics.update({f"race_vs_{name}_gain": gain, f"race_vs_{name}_low": low, f"race_vs_{name}_high": high})
            tags[f"{RACE_SUMMARY}.vs.{name}"] = format_gain(iv)
        metrics.update(_machine_metrics(race.machine_before))
        self.store.log_batch(run_id, metrics=metrics)
        self.store.set_tags(run_id, tags)

    def close(self, status: str = "KILLED") -> None:
        """End the session run (and any run nested in it still RUNNING) with ``status``; idempotent."""
        if not self._session_open or self._session_run_id is None:
            return
        final = _status(status)
        run_id = self._session_run_id
        self._session_open = False
        try:
            for child in self.store.search(f"tags.`{PARENT}` = '{run_id}' and attributes.status = 'RUNNING'"):
                self.store.client.set_terminated(child.info.run_id, final)
        finally:
            self.store.client.set_terminated(run_id, final)

    @contextmanager
    def session(self, recipe: Recipe, *, study_name: str, resume: bool = True) -> Iterator[str]:
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

    def __enter__(self: _S) -> _S:
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

    def note_session(self, notes: Sequence[str]) -> None:
        """Record what the session decided without a trial (space, planner trouble, why it stopped)."""
        self.store.client.set_tag(self._require_session(), SESSION_NOTES, "\n".join(notes)[:4900])

    @property
    def open_run_id(self) -> str | None:
        """The session run while it is open, else ``None``: the run a decision made now nests in."""
        return self._session_run_id if self._session_open else None

    def _require_session(self) -> str:
        if not self._session_open or self._session_run_id is None:
            raise TrackingError("no open session: call start_session() (or use Tracker.session()) first")
        return self._session_run_id

    def _resumable_session(self, study_name: str) -> str | None:
        quoted = study_name.replace("'", "\\'")
        runs = self.store.search(f"tags.`{KIND}` = 'session' and tags.`{STUDY}` = '{quoted}'")
        if not runs:
            return None
        latest = max(runs, key=lambda r: r.info.start_time)
        # Only an interrupted (KILLED) or crashed (FAILED) session is picked up again. A RUNNING
        # one belongs to a worker that is still tuning the same study: sharing its run would let
        # whichever worker finishes first close it under the other's trials, so this worker
        # opens a session run of its own.
        return latest.info.run_id if latest.info.status in ("KILLED", "FAILED") else None

    def _recipe_params(self, recipe: Recipe, study_name: str) -> dict[str, str]:
        params = {STUDY_NAME_PARAM: study_name}
        to_dict = getattr(recipe, "to_dict", None)
        data = jsonable(to_dict()) if callable(to_dict) else {}
        # Locations (tracking, study storage, output) are tags-worthy at most: they move with a
        # checkout and are not what a trial measured.
        for key, value in _flatten(data, "recipe").items():
            if key.split(".")[1] in ("tracking", "study", "output"):
                continue
            params[param_key(key)] = clip_tag(value, 500)
        return params

    def _log_measurement(
        self,
        *,
        kind: str,
        run_name: str,
        parent: str | None,
        policy: RecomputePolicy,
        layer_names: Sequence[str] | None,
        micro_batch: int | None,
        result: TrialResult,
        prediction: Mapping[str, Any] | None,
        reason: str | None,
        extra_params: Mapping[str, str],
        extra_tags: Mapping[str, str] | None = None,
        evidence: Mapping[str, Any] | None = None,
    ) -> str:
        from mlflow.entities import Metric, Param

        r = result_dict(result)
        outcome = str(r["outcome"])
        wall = finite(r.get("wall_s")) or 0.0
        tags = {KIND: kind, OUTCOME: outcome, FINGERPRINT: policy.fingerprint()}
        if parent is not None:
            tags[PARENT] = parent
            if self._study:
                tags[STUDY] = self._study
        if layer_names:
            tags[POLICY_SHORT] = policy.short(layer_names)
        tags.update(_result_tags(r, reason))
        tags.update(extra_tags or {})
        # The run's span in the UI is the trial's own wall time, not the time it took to log it.
        end = now_ms()
        run = self.store.client.create_run(
            self.store.experiment_id, start_time=end - int(wall * 1000), tags=tags, run_name=run_name
        )
        run_id = run.info.run_id
        status = "FAILED" if outcome in _FAILED_OUTCOMES else "FINISHED"
        try:
            params = [
                Param(param_key(f"layer.{name}"), mode) for name, mode in layer_modes(policy, layer_names).items()
            ]
            params += [
                Param(MICRO_BATCH_PARAM, "default" if micro_batch is None else str(micro_batch)),
                Param(POLICY_FINGERPRINT_PARAM, policy.fingerprint()),
                *(Param(k, v) for k, v in extra_params.items()),
            ]
            if policy.compile:
                params.append(Param(COMPILE_PARAM, "true"))
            self.store.log_batch(run_id, params=params, metrics=_result_metrics(r, prediction))
            steps = [
                Metric("step_time_s", float(s), end, i)
                for i, s in enumerate(r.get("step_times_s") or [])
                if finite(s) is not None
            ]
            for i in range(0, len(steps), 1000):
                self.store.client.log_batch(run_id, metrics=steps[i : i + 1000])
            self.store.client.log_text(run_id, policy.to_yaml(), POLICY_ARTIFACT)
            if r.get("stderr_tail"):
                self.store.client.log_text(run_id, str(r["stderr_tail"]), STDERR_TAIL_TXT)
            if evidence is not None:
                self.store.log_json(run_id, EVIDENCE_JSON, evidence)
        except BaseException:
            status = "FAILED"
            raise
        finally:
            self.store.client.set_terminated(run_id, status)
        return run_id


def _result_tags(r: Mapping[str, Any], reason: str | None) -> dict[str, str]:
    """A measurement run's tags from its result: device, throughput unit, why it ended and its error."""
    tags: dict[str, str] = {}
    for key, tag in (("device", DEVICE), ("throughput_unit", THROUGHPUT_UNIT)):
        if r.get(key):
            tags[tag] = str(r[key])
    if reason or r.get("error"):
        tags[REASON] = clip_tag(reason or r["error"])
    if r.get("error"):
        tags[ERROR] = clip_tag(r["error"])
    return tags


def _result_metrics(r: Mapping[str, Any], prediction: Mapping[str, Any] | None) -> dict[str, float]:
    """A measurement run's metrics: what it measured, its noise and machine, and the planner's prediction."""
    metrics: dict[str, float] = {}
    if finite(r.get("compile_s")) is not None:
        metrics[COMPILE_SECONDS_METRIC] = float(r["compile_s"])
    for key in ("peak_bytes", "throughput", "step_time_s", "samples_per_s", "tokens_per_s"):
        v = finite(r.get(key))
        if v is not None:
            metrics[f"measured_{key}"] = v
    for rank, peak in enumerate(r.get("rank_peak_bytes") or ()):
        metrics[rank_peak_metric(rank)] = float(peak)
    metrics.update(_noise_metrics(r.get("step_times_s") or ()))
    metrics.update(_machine_metrics(r.get("machine") or {}))
    wall = finite(r.get("wall_s")) or 0.0
    if wall:
        metrics["wall_s"] = wall
    if finite(r.get("device_total_bytes")) is not None:
        metrics["device_total_bytes"] = float(r["device_total_bytes"])
    for key, value in (prediction or {}).items():
        if finite(value) is not None:
            metrics[f"predicted_{key}"] = float(value)
    return metrics


def _noise_metrics(step_times: Sequence[float]) -> dict[str, float]:
    """`STEP_NOISE_METRICS` of a trial's measured step times (none with fewer than 2 steps)."""
    from tuner.race import spread

    times = [float(t) for t in step_times if finite(t) is not None]
    if len(times) < 2:
        return {}
    sp = spread(times)
    out = {STEP_NOISE_METRICS[0]: sp.mad_rel}
    if sp.ci_rel != float("inf"):
        out[STEP_NOISE_METRICS[1]] = sp.ci_rel
    return out


def _machine_metrics(machine: Mapping[str, Any]) -> dict[str, float]:
    """The numeric parts of a machine state as ``machine_*`` metrics (other GPU processes as a count)."""
    out = {f"{MACHINE_METRIC_PREFIX}{k}": float(v) for k, v in machine.items() if finite(v) is not None}
    if isinstance(machine.get("gpu_processes"), list):
        out[f"{MACHINE_METRIC_PREFIX}gpu_other_processes"] = float(len(machine["gpu_processes"]))
    return out


def _metric_key(label: str) -> str:
    """A label (``baseline full``) as an MLflow metric name part (``baseline_full``)."""
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in label).strip("_") or "entrant"


def _status(status: str) -> str:
    """A status word (FINISHED, ok, interrupted, error...) as the MLflow run status it means."""
    s = str(status).strip()
    if s.upper() in ("FINISHED", "KILLED", "FAILED"):
        return s.upper()
    try:
        return _STATUSES[s.lower()]
    except KeyError:
        valid = ", ".join(["FINISHED", "KILLED", "FAILED", *sorted(_STATUSES)])
        raise TrackingError(f"status: {status!r} is not a run status (valid: {valid})") from None


def _flatten(data: Any, prefix: str) -> dict[str, str]:
    """Nested mappings as ``prefix.key.subkey -> text`` (lists as JSON), for ``recipe.*`` params."""
    if isinstance(data, Mapping) and data:
        out: dict[str, str] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}.{k}"))
        return out
    if isinstance(data, (list, dict)):
        return {prefix: json.dumps(data)}
    return {prefix: "null" if data is None else str(data)}
