"""Tables and text made from tracked trials: ``trials.csv`` and the session's markdown summary.

The rows themselves are `tuner._search.TrialRecord.to_dict`'s (the one trials-table schema)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lightning_recompute.policy import RecomputePolicy
from tuner._tracking.client import TrackingError

if TYPE_CHECKING:
    from tuner._trials import TrialResult

    pass

from lightning_recompute.units import format_bytes, jsonable


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


def session_markdown(
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
