"""A measurement's MLflow run (a trial's or a confirmation's, one shape), and the record of a trial whose owner
died; `SessionLog` decides where each nests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lightning_recompute.mlflow_policy import POLICY_ARTIFACT
from lightning_recompute.policy import RecomputePolicy
from lightning_recompute.units import jsonable
from tuner._tracking.client import TrackingClient, TrackingError, clip_tag, finite, now_ms, param_key
from tuner._tracking.names import (
    COMPILE_PARAM,
    COMPILE_SECONDS_METRIC,
    DEVICE,
    ERROR,
    EVIDENCE_JSON,
    FINGERPRINT,
    KIND,
    MACHINE_METRIC_PREFIX,
    MICRO_BATCH_PARAM,
    OUTCOME,
    PARENT,
    POLICY_FINGERPRINT_PARAM,
    POLICY_SHORT,
    REASON,
    STDERR_TAIL_TXT,
    STEP_NOISE_METRICS,
    STUDY,
    THROUGHPUT_UNIT,
    TRIAL_NUMBER_PARAM,
    rank_peak_metric,
)

if TYPE_CHECKING:
    from tuner._trials import TrialResult

_FAILED_OUTCOMES = ("oom", "timeout", "error", "nonfinite")  # their runs end FAILED, so the UI shows them red


def log_measurement_run(
    store: TrackingClient,
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
    study: str | None = None,
) -> str:
    """Record one measurement as a finished run spanning its wall time; its id. Artifacts: ``policy.yaml``, the
    worker's stderr tail when it failed, ``evidence`` when given."""
    from mlflow.entities import Metric

    r = result_dict(result)
    outcome = str(r["outcome"])
    wall = finite(r.get("wall_s")) or 0.0
    tags = _tags(kind, outcome, policy, layer_names, parent, study)
    tags.update(_result_tags(r, reason))
    tags.update(extra_tags or {})
    # The run's span in the UI is the trial's own wall time, not the time it took to log it.
    end = now_ms()
    run = store.client.create_run(store.experiment_id, start_time=end - int(wall * 1000), tags=tags, run_name=run_name)
    run_id = run.info.run_id
    status = "FAILED" if outcome in _FAILED_OUTCOMES else "FINISHED"
    try:
        params = _params(policy, layer_names, micro_batch, extra_params)
        store.log_batch(run_id, params=params, metrics=_result_metrics(r, prediction))
        steps = [
            Metric("step_time_s", float(s), end, i)
            for i, s in enumerate(r.get("step_times_s") or [])
            if finite(s) is not None
        ]
        for i in range(0, len(steps), 1000):
            store.client.log_batch(run_id, metrics=steps[i : i + 1000])
        store.client.log_text(run_id, policy.to_yaml(), POLICY_ARTIFACT)
        if r.get("stderr_tail"):
            store.client.log_text(run_id, str(r["stderr_tail"]), STDERR_TAIL_TXT)
        if evidence is not None:
            store.log_json(run_id, EVIDENCE_JSON, evidence)
    except BaseException:
        status = "FAILED"
        raise
    finally:
        store.client.set_terminated(run_id, status)
    return run_id


def _params(
    policy: RecomputePolicy, layer_names: Sequence[str] | None, micro_batch: int | None, extra: Mapping[str, str]
) -> list[Any]:
    from mlflow.entities import Param

    params = [Param(param_key(f"layer.{name}"), mode) for name, mode in layer_modes(policy, layer_names).items()]
    params += [*_policy_params(policy, micro_batch), *(Param(k, v) for k, v in extra.items())]
    if policy.compile:
        params.append(Param(COMPILE_PARAM, "true"))
    return params


def _policy_params(policy: RecomputePolicy, micro_batch: int | None) -> list[Any]:
    from mlflow.entities import Param

    mb = "default" if micro_batch is None else str(micro_batch)
    return [Param(MICRO_BATCH_PARAM, mb), Param(POLICY_FINGERPRINT_PARAM, policy.fingerprint())]


def _tags(
    kind: str,
    outcome: str,
    policy: RecomputePolicy,
    layer_names: Sequence[str] | None,
    parent: str | None,
    study: str | None,
) -> dict[str, str]:
    tags = {KIND: kind, OUTCOME: outcome, FINGERPRINT: policy.fingerprint()}
    if parent is not None:
        tags[PARENT] = parent
        if study:
            tags[STUDY] = study
    if layer_names:
        tags[POLICY_SHORT] = policy.short(layer_names)
    return tags


def short_name(policy: RecomputePolicy, layer_names: Sequence[str] | None) -> str:
    """How run names show a policy: its short form over the layers, else its fingerprint."""
    return policy.short(layer_names) if layer_names else policy.fingerprint()


def log_abandoned_run(
    store: TrackingClient,
    number: int,
    policy: RecomputePolicy,
    layer_names: Sequence[str] | None,
    micro_batch: int | None,
    *,
    reason: str,
    parent: str,
    study: str | None,
) -> str:
    from mlflow.entities import Param

    tags = {**_tags("trial", "abandoned", policy, layer_names, parent, study), REASON: clip_tag(reason)}
    tags[ERROR] = clip_tag(reason)
    run_name = f"trial {number} {short_name(policy, layer_names)}"
    run_id = store.client.create_run(store.experiment_id, tags=tags, run_name=run_name).info.run_id
    try:
        store.log_batch(run_id, params=[*_policy_params(policy, micro_batch), Param(TRIAL_NUMBER_PARAM, str(number))])
    finally:
        store.client.set_terminated(run_id, "FAILED")
    return run_id


def _result_tags(r: Mapping[str, Any], reason: str | None) -> dict[str, str]:
    tags: dict[str, str] = {}
    for key, tag in (("device", DEVICE), ("throughput_unit", THROUGHPUT_UNIT)):
        if r.get(key):
            tags[tag] = str(r[key])
    if reason or r.get("error"):
        tags[REASON] = clip_tag(reason or r["error"])
    if r.get("error"):
        tags[ERROR] = clip_tag(r["error"])
    return tags


_MEASURED = ("peak_bytes", "throughput", "step_time_s", "samples_per_s", "tokens_per_s")


def _result_metrics(r: Mapping[str, Any], prediction: Mapping[str, Any] | None) -> dict[str, float]:
    figures = {
        COMPILE_SECONDS_METRIC: r.get("compile_s"),
        **{f"measured_{k}": r.get(k) for k in _MEASURED},
        "wall_s": r.get("wall_s") or None,  # a zero wall time is not logged
        "device_total_bytes": r.get("device_total_bytes"),
        **{f"predicted_{k}": v for k, v in (prediction or {}).items()},
    }
    metrics = {k: float(v) for k, v in figures.items() if finite(v) is not None}
    metrics.update({rank_peak_metric(rank): float(peak) for rank, peak in enumerate(r.get("rank_peak_bytes") or ())})
    metrics.update(_noise_metrics(r.get("step_times_s") or ()))
    metrics.update(machine_metrics(r.get("machine") or {}))
    return metrics


def _noise_metrics(step_times: Sequence[float]) -> dict[str, float]:
    """`STEP_NOISE_METRICS` of a trial's measured step times (none with fewer than 2 steps)."""
    from lightning_recompute.race import spread

    times = [float(t) for t in step_times if finite(t) is not None]
    if len(times) < 2:
        return {}
    sp = spread(times)
    out = {STEP_NOISE_METRICS[0]: sp.mad_rel}
    if sp.ci_rel != float("inf"):
        out[STEP_NOISE_METRICS[1]] = sp.ci_rel
    return out


def machine_metrics(machine: Mapping[str, Any]) -> dict[str, float]:
    """The numeric parts of a machine state as ``machine_*`` metrics (other GPU processes as a count)."""
    out = {f"{MACHINE_METRIC_PREFIX}{k}": float(v) for k, v in machine.items() if finite(v) is not None}
    if isinstance(machine.get("gpu_processes"), list):
        out[f"{MACHINE_METRIC_PREFIX}gpu_other_processes"] = float(len(machine["gpu_processes"]))
    return out


def result_dict(result: TrialResult) -> dict[str, Any]:
    """A TrialResult (or anything with its field names) as a mapping."""
    d = jsonable(result)
    if not isinstance(d, dict) or "outcome" not in d:
        raise TrackingError(f"result: expected a TrialResult with an 'outcome', got {type(result).__name__}")
    return d


def layer_modes(policy: RecomputePolicy, layer_names: Sequence[str] | None) -> dict[str, str]:
    """Per-layer modes (or, without layer names, the policy's own pattern -> mode entries)."""
    if layer_names:
        return {name: policy.choice_for(name) for name in layer_names}
    return {pattern: mode.value for pattern, mode in policy.layers}
