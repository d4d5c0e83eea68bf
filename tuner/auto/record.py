"""What a job that tuned itself leaves behind: the policy file and the MLflow record.

The record has a tuning session's layout (`tuner.tracking.SessionLog`): a session run, one trial run
per candidate with its per-round step times, ``race.json`` and the race's figures, and the session's
summary (trials table, best policy, Pareto plot), so ``mlflow ui`` and the tuner's readers show it
like any session. It goes to the job's ``MLFlowLogger`` store, nested under the job's run, unless
the callback names a tracking URI. A record that cannot be written is a warning, never the end of
the job: the job trains on either way.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_warn

from lightning_recompute import RecomputePolicy
from lightning_recompute.layers import LayerSpec, layer_names
from lightning_recompute.tuned_for import TunedFor
from tuner.auto.candidates import Candidate
from tuner.race import RacePlan, RaceResult
from tuner.trials import TrialResult

__all__ = ["JobTuning", "candidate_results", "record_decision", "tracking_target"]

_log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "auto-recompute"
"""The experiment of a record when the callback names a tracking URI but no experiment."""


@dataclass(frozen=True)
class JobTuning:
    """What a job's tuning decided and measured: everything the record is made of."""

    policy: RecomputePolicy
    """The policy the job settled on."""
    summary: str
    """The decision in words, as logged."""
    candidates: Sequence[Candidate]
    race: RaceResult
    notes: Sequence[str]
    budget_bytes: int
    limit_bytes: int
    modes: Sequence[str]
    plan: RacePlan
    layers: LayerSpec
    micro_batch: int | None
    """Samples in the job's last tuning batch (the policy's ``tuned_for.micro_batch``)."""
    name: str
    """The session's name in MLflow (the study tag)."""
    output: Path | None
    tracking_uri: str | None
    experiment: str | None


def tracking_target(auto: JobTuning, trainer: L.Trainer) -> tuple[str, str, str | None] | None:
    """Where the record goes: ``(tracking URI, experiment, parent run)``, or ``None`` for nowhere."""
    if auto.tracking_uri is not None:
        return auto.tracking_uri, auto.experiment or DEFAULT_EXPERIMENT, None
    for logger in trainer.loggers:
        if isinstance(logger, MLFlowLogger):
            client = logger.experiment
            experiment = auto.experiment or client.get_experiment(logger.experiment_id).name
            return client.tracking_uri, experiment, logger.run_id
    return None


def candidate_results(auto: JobTuning, race: RaceResult, device: str) -> list[tuple[Candidate, TrialResult]]:
    """Each candidate's race as a `TrialResult`: its round times (selection, then estimation) as the
    step times, their median as its step time, its largest metered peak, and how it ended."""
    per_step = race.tokens_per_step or race.samples_per_step
    unit = "tokens/s" if race.tokens_per_step else "samples/s"
    out = []
    for cand in auto.candidates:
        entrant = race.entrants[cand.key]
        times = tuple(t for t in (*entrant.select_s, *entrant.estimate_s) if t is not None)
        median = statistics.median(times) if times else None
        out_reason = entrant.out or ""
        if out_reason.startswith("out of memory"):
            outcome = "oom"
        elif entrant.out is not None:
            outcome = "over_budget"
        else:
            outcome = "ok"
        result = TrialResult(
            outcome=outcome,  # type: ignore[arg-type]
            peak_bytes=entrant.peak_bytes,
            step_time_s=median,
            throughput=(per_step / median) if per_step and median else None,
            throughput_unit=unit,
            step_times_s=times,
            error=entrant.out,
            device=device,
            machine=dict(race.machine_before),
        )
        out.append((cand, result))
    return out


def record_decision(auto: JobTuning, trainer: L.Trainer, pl_module: L.LightningModule) -> str | None:
    """Write the policy file (when asked) and the MLflow record (when there is a store); the session
    run's id, or ``None``. Failures are warnings (see the module docstring)."""
    race = auto.race
    device = torch.cuda.get_device_name(pl_module.device) if pl_module.device.type == "cuda" else "cpu"
    peak = race.entrants[auto.policy.fingerprint()].peak_bytes
    tuned = TunedFor(
        micro_batch=auto.micro_batch,
        data_batch_size=auto.micro_batch,
        peak_bytes=peak,
        limit_bytes=auto.limit_bytes,
        device=device,
    )
    policy = auto.policy.with_tuned_for(tuned)
    if auto.output is not None:
        try:
            policy.save(auto.output)
        except OSError as err:
            rank_zero_warn(f"AutoRecompute: could not write the policy file {auto.output}: {err}")
    target = tracking_target(auto, trainer)
    if target is None:
        return None
    try:
        return _record(auto, trainer, pl_module, race, device, target)
    except Exception as err:  # noqa: BLE001 - the record is a by-product; the job must train on
        _log.debug("AutoRecompute record failed", exc_info=True)
        rank_zero_warn(f"AutoRecompute: the MLflow record was not written ({type(err).__name__}: {err})")
        return None


def _record(
    auto: JobTuning,
    trainer: L.Trainer,
    pl_module: L.LightningModule,
    race: RaceResult,
    device: str,
    target: tuple[str, str, str | None],
) -> str:
    from tuner.search import TrialRecord
    from tuner.stores import open_tracker

    uri, experiment, parent = target
    names = layer_names(pl_module, auto.layers)
    sessions = open_tracker(uri, experiment).sessions
    name = auto.name
    params = _params(auto, trainer)
    run_id = sessions.start_job_session(name, params, parent_run_id=parent)
    rows: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    try:
        for number, (cand, result) in enumerate(candidate_results(auto, race, device)):
            prediction = {"peak_bytes": cand.predicted_peak_bytes, "step_time_s": cand.predicted_step_time_s}
            noise = result.noise
            trial_run = sessions.log_trial(number, cand.policy, names, None, result, prediction=prediction)
            record = TrialRecord(
                number=number,
                state="COMPLETE" if result.outcome in ("ok", "over_budget") else "FAIL",
                outcome=result.outcome,
                policy=cand.policy,
                fingerprint=cand.key,
                short=cand.short,
                micro_batch=None,
                seed=cand.label,
                throughput=result.throughput,
                throughput_unit=result.throughput_unit,
                peak_bytes=result.peak_bytes,
                step_time_s=result.step_time_s,
                noise_rel=None if noise is None else noise.mad_rel,
                predicted_peak_bytes=cand.predicted_peak_bytes,
                predicted_step_time_s=cand.predicted_step_time_s,
                reason=result.error,
                run_id=trial_run,
                feasible=result.outcome == "ok",
            )
            rows.append(record.to_dict())
            if cand.key == auto.policy.fingerprint():
                best = {
                    "policy": auto.policy,
                    "run_id": trial_run,
                    "number": number,
                    "throughput": result.throughput,
                    "peak_bytes": result.peak_bytes,
                    "label": cand.label,
                }
        sessions.log_race(race)
        sessions.note_session([auto.summary, *auto.notes])
    except BaseException:
        sessions.close("FAILED")
        raise
    sessions.finish_session(
        status="FINISHED", best=best, trials_table=rows, baselines={}, budget_bytes=auto.limit_bytes
    )
    return run_id


def _params(auto: JobTuning, trainer: L.Trainer) -> dict[str, str]:
    plan = auto.plan.to_dict()
    params = {
        "auto.budget_bytes": str(auto.budget_bytes),
        "auto.limit_bytes": str(auto.limit_bytes),
        "auto.modes": ",".join(auto.modes),
        "auto.candidates": str(len(auto.candidates)),
        "auto.world_size": str(trainer.world_size),
        "auto.accumulate_grad_batches": str(trainer.accumulate_grad_batches),
    }
    params.update({f"auto.race.{k}": str(v) for k, v in plan.items()})
    return params
