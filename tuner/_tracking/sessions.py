"""Session and trial runs: the session run of a study (resumed after an interruption), one nested
run per trial or confirmation, and the session's summary artifacts when it ends."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from lightning_recompute.policy import RecomputePolicy
from lightning_recompute.units import jsonable
from tuner._tracking.client import (
    TrackingClient,
    TrackingError,
    clip_tag,
    param_key,
)
from tuner._tracking.dead_sessions import end_dead_sessions
from tuner._tracking.measurement import log_abandoned_run, log_measurement_run
from tuner._tracking.names import (
    HEARTBEAT,
    IN_JOB,
    KIND,
    OWNER,
    PARENT,
    RECIPE_CHANGED_ON_RESUME,
    RECIPE_FINGERPRINT,
    RECIPE_NAME,
    RECIPE_YAML,
    RESUMES,
    SESSION_NOTES,
    SOURCE_RUN,
    STUDY,
    STUDY_NAME_PARAM,
    TRIAL_NUMBER_PARAM,
)
from tuner._tracking.session_record import write_race, write_session_record

if TYPE_CHECKING:
    from lightning_recompute.race import RaceResult
    from tuner._trials import TrialResult
    from tuner.recipe import Recipe


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
        run_id = _resumable_session(self.store, study_name) if resume else None
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

        params = _recipe_params(recipe, study_name)
        logged = run.data.params
        # Params are write-once in MLflow; on resume log only new ones and name what changed
        # (e.g. n_trials extended) in a tag instead of failing the resumed session.
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        self.store.log_batch(run_id, params=new)
        if changed:
            self.store.client.set_tag(run_id, RECIPE_CHANGED_ON_RESUME, clip_tag(", ".join(changed)))
        from tuner._liveness import Owner

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
        """Open the session run of a tuning inside a training job (`AutoRecompute`); its run id.

        The layout is a tuning session's (trial runs nest in it, `log_race` and `finish_session` write
        the same records), without a recipe or a study: ``name`` stands for the study, ``params`` say
        what was tuned (budget, candidates, race plan), and the run nests under the job's own run
        (``parent_run_id``, e.g. its ``MLFlowLogger``'s) when there is one. Never resumed: a job that
        restarts from a checkpoint keeps its decision and does not tune again.
        """
        if self._session_open:
            raise TrackingError(f"a session is already open in this tracker (run {self._session_run_id})")
        from tuner._liveness import Owner

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
            result: the `tuner._trials.TrialResult`.
            prediction: the planner's prediction; every numeric entry becomes a ``predicted_<key>``
                metric (``peak_bytes``, ``step_time_s``...).
            reason: why the trial ended as it did, when the caller knows better than the result
                (a planner skip, an Optuna constraint).
        """
        session = self._require_session()
        return log_measurement_run(
            self.store,
            study=self._study,
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
        """The session run's heartbeat (the `tuner._liveness.Heartbeat` thread calls it)."""
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
        return log_abandoned_run(
            self.store, number, policy, layer_names, micro_batch, reason=reason, parent=parent, study=self._study
        )

    def end_dead_sessions(self, study_name: str, grace_s: float) -> list[str]:
        """End KILLED every RUNNING session run of ``study_name`` whose owner is dead; their ids.

        Its nested runs still RUNNING end FAILED. A session run without an owner tag (an older
        version's) is judged by its start time against ``grace_s``, like another host's.
        """
        return end_dead_sessions(self.store, study_name, grace_s, own_run_id=self._session_run_id)

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
        run_id = log_measurement_run(
            self.store,
            study=self._study,
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
            trials_table: rows as `tuner._search.TrialRecord.to_dict` builds them (the study's records,
                which cover trials logged before a resume and other workers' trials); logged as
                ``trials.json`` and ``trials.csv`` and drawn on the Pareto plot.
            baselines: name -> row (``none``, ``full``...) drawn and labelled on the Pareto plot.
            budget_bytes: the memory limit (after the margin), drawn on the plot.
        """
        run_id = self._require_session()
        final = _status(status)
        try:
            write_session_record(self.store, run_id, final, best, trials_table, baselines, budget_bytes)
        finally:
            # Whatever failed above, the run must not stay RUNNING.
            self.close(final)

    def log_race(self, race: RaceResult) -> None:
        """Record the race on the session run: ``race.json`` (every entrant's per-round times, the
        standing, the intervals), its winner and words as tags, its figures as metrics."""
        write_race(self.store, self._require_session(), race)

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


def _resumable_session(store: TrackingClient, study_name: str) -> str | None:
    """The session run of ``study_name`` to resume: the latest, when it was interrupted or crashed."""
    quoted = study_name.replace("'", "\\'")
    runs = store.search(f"tags.`{KIND}` = 'session' and tags.`{STUDY}` = '{quoted}'")
    if not runs:
        return None
    latest = max(runs, key=lambda r: r.info.start_time)
    # Only an interrupted (KILLED) or crashed (FAILED) session is picked up again. A RUNNING
    # one belongs to a worker that is still tuning the same study: sharing its run would let
    # whichever worker finishes first close it under the other's trials, so this worker
    # opens a session run of its own.
    return latest.info.run_id if latest.info.status in ("KILLED", "FAILED") else None


def _recipe_params(recipe: Recipe, study_name: str) -> dict[str, str]:
    """The session run's params: the study name and the recipe's keys, flattened, without its locations."""
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
