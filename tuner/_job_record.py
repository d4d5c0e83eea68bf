"""The MLflow record of a job that tuned itself (`AutoRecompute`) in a tuning session's layout, so ``mlflow ui``
and ``recompute-tune history`` show it like any session; found through the ``lightning_recompute`` entry point."""

from __future__ import annotations

import statistics
from typing import Any

import lightning as L

from lightning_recompute.auto import AutoRecompute
from lightning_recompute.layers import layer_names
from lightning_recompute.race import RaceResult
from tuner._search import TrialRecord
from tuner._tracking import open_tracker
from tuner._trials import TrialResult

__all__ = ["record"]


def record(
    auto: AutoRecompute,
    trainer: L.Trainer,
    pl_module: L.LightningModule,
    race: RaceResult,
    device: str,
    target: tuple[str, str, str | None],
) -> str:
    """Record ``auto``'s race in ``target`` (tracking URI, experiment, the job's own run or ``None``), each candidate
    a trial whose step times are its race rounds; the session run's id."""
    uri, experiment, parent = target
    names = layer_names(pl_module, auto.layers)
    sessions = open_tracker(uri, experiment).sessions
    params = {
        "auto.budget_bytes": str(auto.budget_bytes),
        "auto.limit_bytes": str(auto.limit_bytes),
        "auto.modes": ",".join(auto.modes),
        "auto.candidates": str(len(auto.candidates)),
        "auto.world_size": str(trainer.world_size),
        "auto.accumulate_grad_batches": str(trainer.accumulate_grad_batches),
        **{f"auto.race.{k}": str(v) for k, v in auto.plan.to_dict().items()},
    }
    run_id = sessions.start_job_session(auto.name or f"auto-{type(pl_module).__name__}", params, parent_run_id=parent)
    per_step = race.tokens_per_step or race.samples_per_step
    rows: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    try:
        for number, cand in enumerate(auto.candidates):
            entrant = race.entrants[cand.key]
            times = tuple(t for t in (*entrant.select_s, *entrant.estimate_s) if t is not None)
            median = statistics.median(times) if times else None
            out = entrant.out
            result = TrialResult(
                outcome="ok" if out is None else "oom" if out.startswith("out of memory") else "over_budget",
                peak_bytes=entrant.peak_bytes,
                step_time_s=median,
                throughput=(per_step / median) if per_step and median else None,
                throughput_unit="tokens/s" if race.tokens_per_step else "samples/s",
                step_times_s=times,
                error=out,
                device=device,
                machine=dict(race.machine_before),
            )
            prediction = {"peak_bytes": cand.predicted_peak_bytes, "step_time_s": cand.predicted_step_time_s}
            trial_run = sessions.log_trial(number, cand.policy, names, None, result, prediction=prediction)
            noise = result.noise
            trial = TrialRecord(
                number=number,
                state="COMPLETE" if result.measured else "FAIL",
                outcome=result.outcome,
                policy=cand.policy,
                fingerprint=cand.key,
                short=cand.short,
                micro_batch=None,
                label=cand.label,
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
            rows.append(trial.to_dict())
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
