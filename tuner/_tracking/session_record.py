"""What a session run holds when it ends (trials table, baselines, Pareto plot, best policy, markdown note), and
its race (``race.json``, its words as tags, its "vs" intervals as metrics)."""

from __future__ import annotations

import csv
import io
import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_recompute.policy import RecomputePolicy
from lightning_recompute.units import format_bytes, jsonable
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

if TYPE_CHECKING:
    from lightning_recompute.race import RaceResult


def write_session_record(
    store: TrackingClient,
    run_id: str,
    final: str,
    best: Mapping[str, Any] | None,
    trials_table: Sequence[Mapping[str, Any]],
    baselines: Mapping[str, Mapping[str, Any]],
    budget_bytes: int | None,
) -> None:
    """Write the session's summary on ``run_id`` (ending as ``final``); the arguments are
    `SessionLog.finish_session`'s."""
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
    tags[NOTE] = clip_tag(_markdown(store.experiment, final, best, rows, baselines, budget_bytes))
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
    """A label (``baseline full``) as a metric name part (``baseline_full``)."""
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in label).strip("_") or "entrant"


def _markdown(
    experiment: str,
    status: str,
    best: Mapping[str, Any] | None,
    rows: Sequence[Mapping[str, Any]],
    baselines: Mapping[str, Mapping[str, Any]],
    budget_bytes: int | None,
) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[str(r.get("outcome"))] = counts.get(str(r.get("outcome")), 0) + 1
    lines = [f"**Tuning session {status.lower()}** for experiment `{experiment}`", ""]
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


def trials_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    """``rows`` (trial rows) as CSV: every key any row has is a column, nested values as JSON."""
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
