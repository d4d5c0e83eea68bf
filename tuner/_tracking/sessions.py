"""Session and trial runs: the session run of a study (resumed after an interruption), one nested run per trial
or confirmation, the session's summary when it ends, and dead workers' session runs ended."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import yaml

from lightning_recompute.policy import RecomputePolicy
from lightning_recompute.units import jsonable
from tuner._tracking.client import TrackingClient, TrackingError, clip_tag, param_key
from tuner._tracking.measurement import log_abandoned_run, log_measurement_run, short_name
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
    SESSION_ENDED_BY,
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


_STATUSES = {
    "finished": "FINISHED",
    "ok": "FINISHED",
    "completed": "FINISHED",
    "killed": "KILLED",
    "interrupted": "KILLED",
    "failed": "FAILED",
    "error": "FAILED",
}


class SessionLog:
    """The session run of one study and the runs nested in it. `session` (or `Tracker` as a context manager) ends
    the run FINISHED, KILLED on Ctrl-C, FAILED on an exception; it never stays RUNNING."""

    def __init__(self, store: TrackingClient) -> None:
        self.store = store
        self._session_run_id: str | None = None
        self._session_open = False
        self._study: str | None = None

    def start_session(self, recipe: Recipe, *, study_name: str, resume: bool = True) -> str:
        """Open the session run for ``study_name``; its run id. With ``resume``, the study's latest session run is
        reused when it was interrupted or crashed (`_resumable_session`), so one study keeps one session run."""
        from mlflow.entities import Param

        from tuner._liveness import Owner

        self._ensure_closed()
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
        # Params are write-once in MLflow: on resume log only new ones and name what changed in a tag.
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        self.store.log_batch(run_id, params=new)
        if changed:
            self.store.client.set_tag(run_id, RECIPE_CHANGED_ON_RESUME, clip_tag(", ".join(changed)))
        # The owner and a first heartbeat: another process ends the run KILLED once this owner is dead.
        tags = {
            RECIPE_NAME: str(recipe.name),
            OWNER: json.dumps(Owner.me().to_dict()),
            HEARTBEAT: repr(time.time()),
            RECIPE_FINGERPRINT: str(recipe.fingerprint()),
        }
        self.store.set_tags(run_id, tags)
        self.store.client.log_text(run_id, yaml.safe_dump(jsonable(recipe.to_dict()), sort_keys=False), RECIPE_YAML)
        return run_id

    def start_job_session(self, name: str, params: Mapping[str, str], *, parent_run_id: str | None = None) -> str:
        """Open the session run of a tuning inside a training job (`AutoRecompute`); its run id.

        A tuning session's layout without a recipe or study (``name`` stands for the study), nested under the
        job's own run when there is one; never resumed.
        """
        from mlflow.entities import Param

        from tuner._liveness import Owner

        self._ensure_closed()
        tags = {KIND: "session", STUDY: name, IN_JOB: "true", OWNER: json.dumps(Owner.me().to_dict())}
        if parent_run_id is not None:
            tags[PARENT] = parent_run_id
        run = self.store.client.create_run(self.store.experiment_id, run_name=f"in-job {name}", tags=tags)
        run_id = run.info.run_id
        self._session_run_id, self._session_open, self._study = run_id, True, name
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

        ``layer_names`` ``None`` logs the policy's own pattern entries instead of one param per layer; each
        numeric entry of ``prediction`` becomes a ``predicted_<key>`` metric; ``reason`` overrides the result's.
        """
        session = self._require_session()
        return log_measurement_run(
            self.store,
            study=self._study,
            kind="trial",
            run_name=f"trial {number} {short_name(policy, layer_names)}",
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
        """Record a trial whose owner died mid-trial (FAILED, outcome ``abandoned``) in the dead owner's session
        run when it had one, else in this one; its id."""
        parent = session_run_id or self._require_session()
        return log_abandoned_run(
            self.store, number, policy, layer_names, micro_batch, reason=reason, parent=parent, study=self._study
        )

    def end_dead_sessions(self, study_name: str, grace_s: float) -> list[str]:
        """End KILLED every RUNNING session run of ``study_name`` whose owner is dead, its nested RUNNING runs
        FAILED; their ids."""
        quoted = study_name.replace("'", "\\'")
        ended = []
        for run in self.store.search(
            f"tags.`{KIND}` = 'session' and tags.`{STUDY}` = '{quoted}' and attributes.status = 'RUNNING'"
        ):
            run_id = run.info.run_id
            why = None if run_id == self._session_run_id else dead_owner(run, grace_s, beats=True)
            if why is None:
                continue
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
        """Record the gate's confirmation run (nested in the session when one is open); its id. It has a trial
        run's shape plus ``evidence.json``, so a promoted confirmation run is a self-contained good run."""
        return log_measurement_run(
            self.store,
            study=self._study,
            kind="confirmation",
            run_name=f"confirm {short_name(policy, layer_names)}",
            parent=self.open_run_id,
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

    def finish_session(
        self,
        *,
        status: str,
        best: Mapping[str, Any] | None,
        trials_table: Sequence[Mapping[str, Any]],
        baselines: Mapping[str, Mapping[str, Any]],
        budget_bytes: int | None,
    ) -> None:
        """Write the session's summary (`write_session_record`) and end its run with ``status``.

        Args:
            status: FINISHED, KILLED or FAILED (also: finished/ok, interrupted/killed, failed/error).
            best: the best trial (``policy``, as a `RecomputePolicy` or its dict, and any of ``run_id``,
                ``number``, ``throughput``, ``peak_bytes``, ``micro_batch``), ``None`` when nothing was feasible.
            trials_table: `tuner._search.TrialRecord.to_dict` rows of the whole study.
            baselines: name -> row, labelled on the Pareto plot.
            budget_bytes: the memory limit, drawn on the plot.
        """
        run_id = self._require_session()
        final = _status(status)
        try:
            write_session_record(self.store, run_id, final, best, trials_table, baselines, budget_bytes)
        finally:
            self.close(final)

    def log_race(self, race: RaceResult) -> None:
        """Record the race on the session run (`write_race`)."""
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
        except BaseException as err:
            self.end(err)
            raise
        self.end(None)

    def end(self, err: BaseException | None) -> None:
        """`close` as the way the session ended: FINISHED, KILLED by Ctrl-C, FAILED by another exception."""
        if err is None:
            self.close("FINISHED")
        elif isinstance(err, KeyboardInterrupt):
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

    def _ensure_closed(self) -> None:
        if self._session_open:
            raise TrackingError(f"a session is already open in this tracker (run {self._session_run_id})")

    def _require_session(self) -> str:
        if not self._session_open or self._session_run_id is None:
            raise TrackingError("no open session: call start_session() (or use session()) first")
        return self._session_run_id


def dead_owner(run: Any, grace_s: float, *, beats: bool) -> str | None:
    """Why a RUNNING run's owner (its owner tag, and heartbeat tag with ``beats``) is dead, or ``None``; a run
    without an owner tag (an older version's) is judged by its start time against ``grace_s``."""
    from tuner._liveness import Owner, dead_reason

    t = run.data.tags
    try:
        owner = Owner.from_dict(json.loads(t[OWNER])) if OWNER in t else None
        beat = float(t[HEARTBEAT]) if beats and HEARTBEAT in t else None
    except (ValueError, TypeError):
        owner, beat = None, None
    return dead_reason(owner, beat, grace=grace_s, since=run.info.start_time / 1000.0)


def _resumable_session(store: TrackingClient, study_name: str) -> str | None:
    """The study's latest session run when it was interrupted or crashed; a RUNNING one is another worker's,
    and sharing it would let whichever finishes first close it under the other's trials."""
    quoted = study_name.replace("'", "\\'")
    runs = store.search(f"tags.`{KIND}` = 'session' and tags.`{STUDY}` = '{quoted}'")
    if not runs:
        return None
    latest = max(runs, key=lambda r: r.info.start_time)
    return latest.info.run_id if latest.info.status in ("KILLED", "FAILED") else None


def _recipe_params(recipe: Recipe, study_name: str) -> dict[str, str]:
    """The study name and the recipe's keys, flattened; not its locations (tracking, study, output), which move
    with a checkout and are not what a trial measured."""
    params = {STUDY_NAME_PARAM: study_name}
    for key, value in _flatten(jsonable(recipe.to_dict()), "recipe").items():
        if key.split(".")[1] not in ("tracking", "study", "output"):
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
    """Nested mappings as ``prefix.key.subkey -> text`` (lists as JSON)."""
    if isinstance(data, Mapping) and data:
        out: dict[str, str] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}.{k}"))
        return out
    if isinstance(data, (list, dict)):
        return {prefix: json.dumps(data)}
    return {prefix: "null" if data is None else str(data)}
