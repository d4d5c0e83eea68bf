"""What a session run holds when it ends, and its race: the artifacts, tags and metrics MLflow shows.

`SessionLog` opens, resumes and closes the session run; this module writes its record: the trials
table (``trials.json``, ``trials.csv``), the baselines, the Pareto plot, the best policy and its
figures, the session's Markdown note, and the race (``race.json``, its words as tags, its "vs"
intervals as metrics).
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_recompute.policy import RecomputePolicy
from tuner._tracking.client import TrackingClient, clip_tag, finite
from tuner._tracking.measurement import machine_metrics
from tuner._tracking.names import (
    BASELINES_JSON,
    BEST_FINGERPRINT,
    BEST_JSON,
    BEST_POLICY_YAML,
    BEST_RUN,
    NOTE,
    RACE_JSON,
    RACE_SUMMARY,
    RACE_WINNER,
    SESSION_STATUS,
    TRIALS_CSV,
    TRIALS_JSON,
)
from tuner._tracking.report import session_markdown, trials_csv

if TYPE_CHECKING:
    from lightning_recompute.race import RaceResult

__all__ = ["write_race", "write_session_record"]


def write_session_record(
    store: TrackingClient,
    run_id: str,
    final: str,
    best: Mapping[str, Any] | None,
    trials_table: Sequence[Mapping[str, Any]],
    baselines: Mapping[str, Mapping[str, Any]],
    budget_bytes: int | None,
) -> None:
    """Write the session's summary artifacts, tags and metrics on ``run_id`` (ending as ``final``);
    the arguments are `SessionLog.finish_session`'s."""
    rows = [dict(r) for r in trials_table]
    store.log_json(run_id, TRIALS_JSON, rows)
    store.client.log_text(run_id, trials_csv(rows), TRIALS_CSV)
    store.log_json(run_id, BASELINES_JSON, baselines)
    with tempfile.TemporaryDirectory(prefix="recompute-plot-") as tmp:
        from tuner._plots import pareto_plot

        png = pareto_plot(
            rows,
            Path(tmp) / "pareto.png",
            baselines=baselines,
            budget_bytes=budget_bytes,
            title=f"{store.experiment}: peak memory vs throughput",
        )
        store.client.log_artifact(run_id, str(png))
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
            store.client.log_text(run_id, policy.to_yaml(), BEST_POLICY_YAML)
            tags[BEST_FINGERPRINT] = policy.fingerprint()
        store.log_json(run_id, BEST_JSON, best)
        if best.get("run_id"):
            tags[BEST_RUN] = str(best["run_id"])
        for key in ("throughput", "peak_bytes"):
            if finite(best.get(key)) is not None:
                metrics[f"best_{key}"] = float(best[key])
    store.log_batch(run_id, metrics=metrics)
    tags[NOTE] = clip_tag(session_markdown(store.experiment, final, best, rows, baselines, budget_bytes))
    store.set_tags(run_id, tags)


def write_race(store: TrackingClient, run_id: str, race: RaceResult) -> None:
    """Record ``race`` on the session run ``run_id``: ``race.json`` (every entrant's per-round times, the
    standing, the intervals), its winner and words as tags, its figures as metrics."""
    from lightning_recompute.race import format_gain

    store.log_json(run_id, RACE_JSON, race.to_dict())
    words = [f"race {race.outcome}" + (f": {race.reason}" if race.reason else "")]
    if race.ok:
        words.append(f"{race.select_rounds} selection rounds ({race.stop}), {race.estimate_rounds} estimation rounds")
        words += [*race.decision_lines(), *race.headlines()]
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
    metrics.update(machine_metrics(race.machine_before))
    store.log_batch(run_id, metrics=metrics)
    store.set_tags(run_id, tags)


def _metric_key(label: str) -> str:
    """A label (``baseline full``) as an MLflow metric name part (``baseline_full``)."""
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in label).strip("_") or "entrant"
