"""The Pareto plot of a tuning session, drawn on an Agg canvas, never ``pyplot`` (no global state, no display)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Point = tuple[float, float]
_STYLES = {"ok": ("tab:blue", "o", "ok"), "over_budget": ("tab:orange", "x", "over budget")}
_OTHER = ("tab:gray", ".", "other")


def _point(row: Mapping[str, Any]) -> Point | None:
    """``(peak_bytes, throughput)`` of a trials-table row, or ``None`` when it measured nothing."""
    values: list[Any] = [row.get("peak_bytes"), row.get("throughput")]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        return None
    return float(values[0]), float(values[1])


def pareto_front(points: Sequence[Point]) -> list[int]:
    """Indexes of the ``(peak_bytes, throughput)`` points no other point beats (less or equal memory *and*
    more or equal throughput), by increasing memory; of equal points only the first."""
    front: list[int] = []
    for i in sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1], i)):
        if not front or points[i][1] > points[front[-1]][1]:
            front.append(i)
    return front


def pareto_plot(
    trials: Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    baselines: Mapping[str, Mapping[str, Any]] | None = None,
    budget_bytes: int | None = None,
    title: str = "Recompute policies: peak memory vs throughput",
) -> Path:
    """Draw the trials (rows of `tuner._search.TrialRecord.to_dict`; a duplicate is drawn as the trial it
    repeats), the front within the budget, the baselines and the budget to a PNG at ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    baselines = baselines or {}
    rows = [*trials, *baselines.values()]
    unit = next((str(r["throughput_unit"]) for r in rows if r.get("throughput_unit")), "samples/s")
    measured = [(row, p) for row in trials if row.get("duplicate_of") is None and (p := _point(row)) is not None]
    base_pts = {name: _point(row) for name, row in baselines.items()}
    most = max([p[0] for r in rows if (p := _point(r))] + [budget_bytes or 0], default=0)
    units = [(2.0**e, name) for e, name in ((30, "GiB"), (20, "MiB"), (10, "KiB")) if most >= 2**e]
    scale, scale_name = units[0] if units else (1.0, "bytes")

    fig = Figure(figsize=(8.0, 5.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    groups: dict[tuple[str, str, str], list[Point]] = {}
    for row, p in measured:
        groups.setdefault(_STYLES.get(str(row.get("outcome", "ok")), _OTHER), []).append(p)
    for (color, marker, label), pts in groups.items():
        ax.scatter([x / scale for x, _ in pts], [y for _, y in pts], c=color, marker=marker, label=label, zorder=3)
    # The front over what a user could adopt: measured and within the budget, its points numbered.
    fits = [(r, p) for r, p in measured if r.get("outcome", "ok") == "ok" and p[0] <= (budget_bytes or math.inf)]
    front = [fits[i] for i in pareto_front([p for _, p in fits])]
    if front:
        xs, ys = [p[0] / scale for _, p in front], [p[1] for _, p in front]
        ax.plot(xs, ys, color="tab:green", drawstyle="steps-post", linewidth=1.5, label="Pareto front", zorder=2)
        for (row, _), x, y in zip(front, xs, ys, strict=True):
            if row.get("number") is not None:
                ax.annotate(f"#{row['number']}", (x, y), xytext=(4, 4), textcoords="offset points", fontsize=7)
    missing = []
    for name, p in base_pts.items():
        if p is None:
            missing.append(f"{name}: {baselines[name].get('outcome') or 'not measured'}")
            continue
        ax.scatter([p[0] / scale], [p[1]], marker="*", s=180, c="tab:red", edgecolors="black", zorder=4)
        ax.annotate(name, (p[0] / scale, p[1]), xytext=(6, -12), textcoords="offset points", color="tab:red")
    if base_pts:
        label = "baselines" + (f" ({'; '.join(missing)})" if missing else "")
        ax.scatter([], [], marker="*", s=120, c="tab:red", edgecolors="black", label=label)
    if budget_bytes:
        limit = budget_bytes / scale
        ax.axvline(limit, color="tab:red", linestyle="--", label=f"budget {limit:.3g} {scale_name}")
    if not measured and not any(base_pts.values()):
        ax.text(0.5, 0.5, "no trial measured memory and throughput", transform=ax.transAxes, ha="center")
    ax.set(xlabel=f"peak memory ({scale_name})", ylabel=f"throughput ({unit})", title=title)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
