"""Session and measurement runs: the session run of a study (resumed after an interruption), one nested run per
trial or confirmation (one shape), the session's summary and race when it ends, and dead workers' runs ended."""

from __future__ import annotations

import csv
import io
import json
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from lightning_recompute.mlflow_policy import POLICY_ARTIFACT
from lightning_recompute.policy import RecomputePolicy
from lightning_recompute.units import format_bytes, jsonable
from tuner._tracking import names as N
from tuner._tracking.client import TrackingClient, TrackingError, clip_tag, finite, param_key

if TYPE_CHECKING:
    from lightning_recompute.race import RaceResult
    from tuner._trials import TrialResult
    from tuner.recipe import Recipe

_FAILED_OUTCOMES = ("oom", "timeout", "error", "nonfinite", "abandoned")  # their runs end FAILED: red in the UI
_MEASURED = ("peak_bytes", "throughput", "step_time_s", "samples_per_s", "tokens_per_s")


class SessionLog:
    """The session run of one study and the runs nested in it. `session` (or `Tracker` as a context manager) ends
    the run FINISHED, KILLED on Ctrl-C, FAILED on an exception; it never stays RUNNING."""

    def __init__(self, store: TrackingClient) -> None:
        self.store = store
        self.open_run_id: str | None = None  # the session run while open: the run a decision made now nests in
        self._study: str | None = None

    def start_session(self, recipe: Recipe, *, study_name: str, resume: bool = True) -> str:
        """Open the session run for ``study_name``; its run id. With ``resume``, the study's latest session run is
        reused when it was interrupted or crashed (a RUNNING one is another worker's, and sharing it would let
        whichever finishes first close it under the other's trials), so one study keeps one session run."""
        runs = self.store.search(_session_filter(study_name)) if resume else []
        latest = max(runs, key=lambda r: r.info.start_time, default=None)
        resumed = latest if latest is not None and latest.info.status in ("KILLED", "FAILED") else None
        settings = jsonable(recipe.to_dict())
        params = {N.STUDY_NAME_PARAM: study_name}
        for key, value in _flatten(settings, "recipe").items():
            # Not its locations (tracking, study, output): they move with a checkout and are not what a trial measured.
            if key.split(".")[1] not in ("tracking", "study", "output"):
                params[key] = value
        tags = {N.KIND: "session", N.STUDY: study_name}
        run_id = self._open(f"session {study_name}", tags, study_name, params, resumed)
        # The owner and a first heartbeat: another process ends the run KILLED once this owner is dead.
        tags = {N.RECIPE_NAME: str(recipe.name), N.OWNER: _owner(), N.HEARTBEAT: repr(time.time())}
        self.store.log_batch(run_id, tags={**tags, N.RECIPE_FINGERPRINT: str(recipe.fingerprint())})
        self.store.client.log_text(run_id, yaml.safe_dump(settings, sort_keys=False), N.RECIPE_YAML)
        return run_id

    def start_job_session(self, name: str, params: Mapping[str, str], *, parent_run_id: str | None = None) -> str:
        """Open the session run of a tuning inside a training job (`AutoRecompute`), nested under the job's own run
        when there is one and never resumed; ``name`` stands for the study."""
        tags = {N.KIND: "session", N.STUDY: name, N.IN_JOB: "true", N.OWNER: _owner()}
        if parent_run_id is not None:
            tags[N.PARENT] = parent_run_id
        return self._open(f"in-job {name}", tags, name, params)

    def _open(
        self, run_name: str, tags: dict[str, str], study: str, params: Mapping[str, str], resumed: Any = None
    ) -> str:
        if self.open_run_id is not None:
            raise TrackingError(f"a session is already open in this tracker (run {self.open_run_id})")
        client = self.store.client
        if resumed is not None:
            run_id = resumed.info.run_id
            client.update_run(run_id, status="RUNNING")
            client.set_tag(run_id, N.RESUMES, str(int(resumed.data.tags.get(N.RESUMES, "0")) + 1))
        else:
            run_id = client.create_run(self.store.experiment_id, run_name=run_name, tags=tags).info.run_id
        self.open_run_id, self._study = run_id, study
        # Params are write-once in MLflow: on resume log only new ones and name what changed in a tag.
        logged = client.get_run(run_id).data.params
        values = {param_key(k): clip_tag(v, 500) for k, v in params.items()}
        changed = ", ".join(sorted(k for k, v in values.items() if k in logged and logged[k] != v))
        self.store.log_batch(
            run_id,
            params={k: v for k, v in values.items() if k not in logged},
            tags={N.RECIPE_CHANGED_ON_RESUME: changed} if changed else None,
        )
        return run_id

    def _require_session(self) -> str:
        if self.open_run_id is None:
            raise TrackingError("no open session: call start_session() (or use session()) first")
        return self.open_run_id

    def log_trial(
        self,
        number: int | None,
        policy: RecomputePolicy,
        layer_names: Sequence[str] | None,
        micro_batch: int | None,
        result: TrialResult,
        prediction: Mapping[str, Any] | None = None,
        reason: str | None = None,
        *,
        source: str | None = None,
        evidence: Mapping[str, Any] | None = None,
    ) -> str:
        """Record trial ``number`` (``None``: the gate's confirmation) as a finished run spanning its own wall time;
        its run id. ``layer_names`` ``None`` logs the policy's own patterns instead of its layers."""
        parent = self.open_run_id if number is None else self._require_session()
        r = jsonable(result)
        start = int(time.time() * 1000) - int((finite(r.get("wall_s")) or 0.0) * 1000)
        reason = reason or r.get("error")
        with self._trial_run(number, policy, layer_names, micro_batch, r, parent, reason, source, start) as run_id:
            if layer_names:
                params = {f"layer.{name}": policy.choice_for(name) for name in layer_names}
            else:  # the policy's own patterns
                params = {f"layer.{pattern}": mode.value for pattern, mode in policy.layers}
            if policy.compile:
                params[N.COMPILE_PARAM] = "true"
            metrics = _result_metrics(r, prediction)
            self.store.log_batch(run_id, params=params, metrics=metrics, step_times=r.get("step_times_s") or ())
            self.store.client.log_text(run_id, policy.to_yaml(), POLICY_ARTIFACT)
            if r.get("stderr_tail"):
                self.store.client.log_text(run_id, str(r["stderr_tail"]), N.STDERR_TAIL_TXT)
            if evidence is not None:
                self.store.client.log_dict(run_id, jsonable(evidence), N.EVIDENCE_JSON)
        return run_id

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
        """Record a trial whose owner died mid-trial (FAILED, outcome ``abandoned``, nothing measured) in the dead
        owner's session run when it had one, else in this one; its id."""
        parent = session_run_id or self._require_session()
        result = {"outcome": "abandoned", "error": reason}
        with self._trial_run(number, policy, layer_names, micro_batch, result, parent, reason) as run_id:
            pass  # nothing was measured: it holds what every trial run has
        return run_id

    @contextmanager
    def _trial_run(
        self,
        number: int | None,
        policy: RecomputePolicy,
        layer_names: Sequence[str] | None,
        micro_batch: int | None,
        r: Mapping[str, Any],
        parent: str | None,
        reason: str | None,
        source: str | None = None,
        start_time: int | None = None,
    ) -> Iterator[str]:
        """A run of trial result ``r`` (a confirmation's without ``number``) holding what every trial run has."""
        kind, title = ("trial", f"trial {number}") if number is not None else ("confirmation", "confirm")
        short = policy.short(layer_names) if layer_names else None
        tags = {
            N.KIND: kind,
            N.OUTCOME: str(r["outcome"]),
            N.FINGERPRINT: policy.fingerprint(),
            N.PARENT: parent,
            N.STUDY: self._study if parent is not None else None,
            N.POLICY_SHORT: short,
        }
        said = {N.DEVICE: r.get("device"), N.THROUGHPUT_UNIT: r.get("throughput_unit"), N.REASON: reason}
        tags.update((k, v) for k, v in {**said, N.ERROR: r.get("error"), N.SOURCE_RUN: source}.items() if v)
        params = {
            N.MICRO_BATCH_PARAM: "default" if micro_batch is None else str(micro_batch),
            N.POLICY_FINGERPRINT_PARAM: policy.fingerprint(),
        }
        if number is not None:
            params[N.TRIAL_NUMBER_PARAM] = str(number)
        end = "FAILED" if r["outcome"] in _FAILED_OUTCOMES else "FINISHED"
        with self.store.run(f"{title} {short or policy.fingerprint()}", tags, end=end, start_time=start_time) as run_id:
            self.store.log_batch(run_id, params=params)
            yield run_id

    def beat(self) -> None:
        """The session run's heartbeat (the `tuner._liveness.Heartbeat` thread calls it)."""
        if self.open_run_id is not None:
            self.store.client.set_tag(self.open_run_id, N.HEARTBEAT, repr(time.time()))

    def end_dead_sessions(self, study_name: str, grace_s: float) -> list[str]:
        """End KILLED every RUNNING session run of ``study_name`` whose owner is dead; their ids."""
        return self.end_dead(_session_filter(study_name), N.SESSION_ENDED_BY, grace_s)

    def end_dead(self, filter_string: str, ended_by: str, grace_s: float) -> list[str]:
        """End KILLED the RUNNING runs matching ``filter_string`` whose owner is dead (why in tag ``ended_by``; a run
        without an owner tag is judged by its start), the runs nested in them FAILED; their ids."""
        from tuner._liveness import Owner, dead_reason

        ended = []
        for run in self.store.search(f"{filter_string} and attributes.status = 'RUNNING'"):
            t = run.data.tags
            try:
                owner = Owner.from_dict(json.loads(t[N.OWNER])) if N.OWNER in t else None
                beat = float(t[N.HEARTBEAT]) if N.HEARTBEAT in t else None
            except (ValueError, TypeError):
                owner, beat = None, None
            why = dead_reason(owner, beat, grace=grace_s, since=run.info.start_time / 1000.0)
            if why is not None and run.info.run_id != self.open_run_id:
                self.store.client.set_tag(run.info.run_id, ended_by, clip_tag(why))
                self._end(run.info.run_id, "KILLED", children="FAILED")
                ended.append(run.info.run_id)
        return ended

    def _end(self, run_id: str, status: str, children: str) -> None:
        try:
            for child in self.store.search(f"tags.`{N.PARENT}` = '{run_id}' and attributes.status = 'RUNNING'"):
                self.store.client.set_terminated(child.info.run_id, children)
        finally:
            self.store.client.set_terminated(run_id, status)

    def note_session(self, notes: Sequence[str]) -> None:
        """Record what the session decided without a trial (space, planner trouble, why it stopped)."""
        self.store.client.set_tag(self._require_session(), N.SESSION_NOTES, "\n".join(notes)[:4900])

    def log_race(self, race: RaceResult) -> None:
        """Record ``race`` on the session run: ``race.json`` (every entrant's per-round times, the standing, the
        intervals), its winner and words as tags, its figures as metrics."""
        from lightning_recompute.race import format_gain

        run_id = self._require_session()
        self.store.client.log_dict(run_id, jsonable(race.to_dict()), N.RACE_JSON)
        words = [f"race {race.outcome}" + (f": {race.reason}" if race.reason else "")]
        if race.ok:
            words.append(
                f"{race.select_rounds} selection rounds ({race.stop}), {race.estimate_rounds} estimation rounds"
            )
            words += [*race.decision_lines(), *race.headlines()]
        tags = {N.RACE_SUMMARY: "; ".join(words)}
        metrics: dict[str, float] = {"race_wall_s": race.wall_s, "race_rounds": float(race.select_rounds)}
        if race.winner is not None:
            tags[N.RACE_WINNER] = race.winner
            if (thr := race.throughput(race.winner)) is not None:
                metrics["race_winner_throughput"] = thr
        for key, iv in race.vs.items():
            label = race.entrants[key].labels[-1] if race.entrants[key].labels else key
            name = "".join(c if c.isalnum() or c in "_-." else "_" for c in label).strip("_") or "entrant"
            metrics.update(zip((f"race_vs_{name}_{x}" for x in ("gain", "low", "high")), iv.gain(), strict=True))
            tags[f"{N.RACE_SUMMARY}.vs.{name}"] = format_gain(iv, race.confidence)
        metrics.update(machine_metrics(race.machine_before))
        self.store.log_batch(run_id, metrics=metrics, tags=tags)

    def finish_session(
        self,
        *,
        status: str,
        best: Mapping[str, Any] | None,
        trials_table: Sequence[Mapping[str, Any]],
        baselines: Mapping[str, Mapping[str, Any]],
        budget_bytes: int | None,
    ) -> None:
        """Write the session's summary and artifacts and end its run with ``status``; ``best`` is ``None`` when
        nothing was feasible."""
        from tuner._plots import pareto_plot

        run_id, client = self._require_session(), self.store.client
        try:
            rows = [dict(r) for r in trials_table]
            client.log_dict(run_id, jsonable(rows), N.TRIALS_JSON)
            client.log_text(run_id, trials_csv(rows), N.TRIALS_CSV)
            client.log_dict(run_id, jsonable(baselines), N.BASELINES_JSON)
            with tempfile.TemporaryDirectory(prefix="recompute-plot-") as tmp:
                title = f"{self.store.experiment}: peak memory vs throughput"
                png = pareto_plot(
                    rows, Path(tmp) / "pareto.png", baselines=baselines, budget_bytes=budget_bytes, title=title
                )
                client.log_artifact(run_id, str(png))
            ok = sum(1 for r in rows if r.get("outcome") == "ok")
            metrics: dict[str, float] = {"trials_total": len(rows), "trials_ok": ok}
            if budget_bytes is not None:
                metrics["budget_limit_bytes"] = budget_bytes
            tags = {N.SESSION_STATUS: status}
            if best is not None:
                if (policy := best.get("policy")) is not None:
                    policy = policy if isinstance(policy, RecomputePolicy) else RecomputePolicy.from_dict(policy)
                    client.log_text(run_id, policy.to_yaml(), N.BEST_POLICY_YAML)
                    tags[N.BEST_FINGERPRINT] = policy.fingerprint()
                client.log_dict(run_id, jsonable(best), N.BEST_JSON)
                if best.get("run_id"):
                    tags[N.BEST_RUN] = str(best["run_id"])
                for key in ("throughput", "peak_bytes"):
                    if finite(best.get(key)) is not None:
                        metrics[f"best_{key}"] = float(best[key])
            tags[N.NOTE] = _markdown(self.store.experiment, status, best, rows, baselines, budget_bytes)
            self.store.log_batch(run_id, metrics=metrics, tags=tags)
        finally:
            self.close(status)

    def close(self, status: str = "KILLED") -> None:
        """End the session run (and any run nested in it still RUNNING) with ``status``; idempotent."""
        if self.open_run_id is not None:
            run_id, self.open_run_id = self.open_run_id, None
            self._end(run_id, status, children=status)

    def end(self, err: BaseException | None) -> None:
        """`close` as the way the session ended: FINISHED, KILLED by Ctrl-C, FAILED by another exception."""
        self.close("FINISHED" if err is None else "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED")

    @contextmanager
    def session(self, recipe: Recipe, *, study_name: str, resume: bool = True) -> Iterator[str]:
        """`start_session` ... `end`."""
        run_id = self.start_session(recipe, study_name=study_name, resume=resume)
        try:
            yield run_id
        except BaseException as err:
            self.end(err)
            raise
        self.end(None)


def _owner() -> str:
    from tuner._liveness import Owner

    return json.dumps(Owner.me().to_dict())


def _session_filter(study_name: str) -> str:
    quoted = study_name.replace("'", "\\'")
    return f"tags.`{N.KIND}` = 'session' and tags.`{N.STUDY}` = '{quoted}'"


def _flatten(data: Any, prefix: str) -> dict[str, str]:
    """Nested mappings as ``prefix.key.subkey -> text`` (lists as JSON)."""
    if isinstance(data, Mapping) and data:
        return {k: v for key, value in data.items() for k, v in _flatten(value, f"{prefix}.{key}").items()}
    if isinstance(data, (list, dict)):
        return {prefix: json.dumps(data)}
    return {prefix: "null" if data is None else str(data)}


def _result_metrics(r: Mapping[str, Any], prediction: Mapping[str, Any] | None) -> dict[str, float]:
    from lightning_recompute.race import spread

    figures = {
        N.COMPILE_SECONDS_METRIC: r.get("compile_s"),
        **{f"measured_{k}": r.get(k) for k in _MEASURED},
        "wall_s": r.get("wall_s") or None,  # a zero wall time is not logged
        "device_total_bytes": r.get("device_total_bytes"),
        **{f"predicted_{k}": v for k, v in (prediction or {}).items()},
    }
    metrics = {k: float(v) for k, v in figures.items() if finite(v) is not None}
    metrics.update({N.rank_peak_metric(rank): float(peak) for rank, peak in enumerate(r.get("rank_peak_bytes") or ())})
    times = [float(t) for t in r.get("step_times_s") or () if finite(t) is not None]
    if len(times) >= 2:  # the trial's noise
        sp = spread(times)
        metrics[N.STEP_NOISE_METRICS[0]] = sp.mad_rel
        if sp.ci_rel != float("inf"):
            metrics[N.STEP_NOISE_METRICS[1]] = sp.ci_rel
    metrics.update(machine_metrics(r.get("machine") or {}))
    return metrics


def machine_metrics(machine: Mapping[str, Any]) -> dict[str, float]:
    """The numeric parts of a machine state as ``machine_*`` metrics (other GPU processes as a count)."""
    out = {f"{N.MACHINE_METRIC_PREFIX}{k}": float(v) for k, v in machine.items() if finite(v) is not None}
    if isinstance(machine.get("gpu_processes"), list):
        out[f"{N.MACHINE_METRIC_PREFIX}gpu_other_processes"] = float(len(machine["gpu_processes"]))
    return out


def _markdown(
    experiment: str,
    status: str,
    best: Mapping[str, Any] | None,
    rows: Sequence[Mapping[str, Any]],
    baselines: Mapping[str, Mapping[str, Any]],
    budget_bytes: int | None,
) -> str:
    counts = Counter(str(r.get("outcome")) for r in rows)
    lines = [
        f"**Tuning session {status.lower()}** for experiment `{experiment}`",
        "",
        f"- budget limit: {format_bytes(budget_bytes)}",
        f"- trials: {len(rows)} (" + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + ")",
        "- best: none within the budget"
        if best is None
        else f"- best: trial {best.get('number', '?')}, throughput {best.get('throughput', '?')}, "
        f"peak {format_bytes(best.get('peak_bytes'))} (`best_policy.yaml`)",
    ]
    for name, b in baselines.items():
        lines.append(
            f"- baseline {name}: throughput {b.get('throughput', '?')}, peak {format_bytes(b.get('peak_bytes'))}"
            + (f", {b['outcome']}" if b.get("outcome") else "")
        )
    return "\n".join([*lines, "", "Artifacts: `pareto.png`, `trials.csv`, `trials.json`, `recipe.yaml`."])


def trials_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    """``rows`` (trial rows) as CSV: every key any row has is a column, nested values (a policy) as JSON so a
    spreadsheet cell can be parsed back."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for r in rows for k in r)), lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: _json(v) if isinstance(v, (Mapping, list, tuple)) else v for k, v in r.items()})
    return buf.getvalue()


def _json(value: Any) -> str:
    return json.dumps(jsonable(value), separators=(",", ":"))
