"""The Pareto plot of a tuning session: peak memory against throughput, one point per trial.

Drawn with matplotlib's object API on an Agg canvas, never ``pyplot``: the tuner may run headless and
must not touch a global figure state or a display backend.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["pareto_front", "pareto_plot"]

_OUTCOME_STYLE = {
    "ok": ("tab:blue", "o", "ok"),
    "over_budget": ("tab:orange", "x", "over budget"),
}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def _point(row: Mapping[str, Any]) -> tuple[float, float] | None:
    """``(peak_bytes, throughput)`` of a trials-table row, or ``None`` when it measured nothing."""
    peak = _number(row.get("peak_bytes"))
    thr = _number(row.get("throughput"))
    if peak is None or thr is None:
        return None
    return peak, thr


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indexes of the ``(peak_bytes, throughput)`` points no other point beats (less or equal memory *and*
    more or equal throughput), by increasing memory; of equal points only the first."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1], i))
    front: list[int] = []
    best = -math.inf
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def _unit(max_bytes: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if max_bytes >= scale:
            return float(scale), name
    return 1.0, "bytes"


def pareto_plot(
    trials: Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    baselines: Mapping[str, Mapping[str, Any]] | None = None,
    budget_bytes: int | None = None,
    throughput_unit: str | None = None,
    title: str = "Recompute policies: peak memory vs throughput",
) -> Path:
    """Draw the trials, the front, the baselines and the budget to a PNG at ``path``.

    Args:
        trials: trials-table rows (`tuner._search.TrialRecord.to_dict`); drawn when they have ``peak_bytes``
            and ``throughput`` and no ``duplicate_of``.
        path: the PNG to write (folders are created); returned.
        baselines: name -> row of the same shape; each is drawn and labelled (one that measured nothing
            is named in the legend).
        budget_bytes: the memory limit, drawn as a vertical line.
        throughput_unit: the y axis unit; default: the rows' ``throughput_unit``, else "samples/s".
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    baselines = dict(baselines or {})
    unit = throughput_unit or next(
        (str(r["throughput_unit"]) for r in [*trials, *baselines.values()] if r.get("throughput_unit")), "samples/s"
    )
    # A duplicate carries the figures of the trial it repeats.
    measured = [(row, p) for row in trials if row.get("duplicate_of") is None and (p := _point(row)) is not None]
    base_pts = {name: _point(row) for name, row in baselines.items()}
    all_bytes = (
        [p[0] for _, p in measured] + [p[0] for p in base_pts.values() if p] + ([budget_bytes] if budget_bytes else [])
    )
    scale, scale_name = _unit(max(all_bytes, default=0.0))

    fig = Figure(figsize=(8.0, 5.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)

    _draw_trials(ax, measured, scale)
    _draw_front(ax, measured, scale, budget_bytes)
    _draw_baselines(ax, baselines, base_pts, scale)

    if budget_bytes:
        ax.axvline(
            budget_bytes / scale,
            color="tab:red",
            linestyle="--",
            linewidth=1.2,
            label=f"budget {budget_bytes / scale:.3g} {scale_name}",
        )

    if not measured and not any(base_pts.values()):
        ax.text(0.5, 0.5, "no trial measured memory and throughput", transform=ax.transAxes, ha="center", va="center")
    ax.set_xlabel(f"peak memory ({scale_name})")
    ax.set_ylabel(f"throughput ({unit})")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


Point = tuple[float, float]


def _draw_trials(ax: Any, measured: Sequence[tuple[Mapping[str, Any], Point]], scale: float) -> None:
    """Every measured trial, its marker by outcome."""
    for outcome, (color, marker, label) in _OUTCOME_STYLE.items():
        pts = [p for row, p in measured if str(row.get("outcome", "ok")) == outcome]
        if pts:
            ax.scatter(
                [x / scale for x, _ in pts],
                [y for _, y in pts],
                c=color,
                marker=marker,
                label=label,
                alpha=0.75,
                zorder=3,
            )
    other = [p for row, p in measured if str(row.get("outcome", "ok")) not in _OUTCOME_STYLE]
    if other:
        ax.scatter(
            [x / scale for x, _ in other], [y for _, y in other], c="tab:gray", marker=".", label="other", zorder=3
        )


def _draw_front(
    ax: Any, measured: Sequence[tuple[Mapping[str, Any], Point]], scale: float, budget_bytes: int | None
) -> None:
    """The Pareto front over what a user could adopt (measured and within budget), its points numbered."""
    feasible = [
        (row, p)
        for row, p in measured
        if str(row.get("outcome", "ok")) == "ok" and (budget_bytes is None or p[0] <= budget_bytes)
    ]
    if not feasible:
        return
    idx = pareto_front([p for _, p in feasible])
    xs = [feasible[i][1][0] / scale for i in idx]
    ys = [feasible[i][1][1] for i in idx]
    ax.plot(xs, ys, color="tab:green", drawstyle="steps-post", linewidth=1.5, label="Pareto front", zorder=2)
    for i in idx:
        number = feasible[i][0].get("number")
        if number is not None:
            ax.annotate(
                f"#{number}",
                (feasible[i][1][0] / scale, feasible[i][1][1]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
                color="tab:green",
            )


def _draw_baselines(
    ax: Any, baselines: Mapping[str, Mapping[str, Any]], base_pts: Mapping[str, Point | None], scale: float
) -> None:
    """Each baseline as a labelled star; one that measured nothing is named in the legend."""
    missing = []
    for name, p in base_pts.items():
        if p is None:
            baseline_outcome = baselines[name].get("outcome")
            missing.append(f"{name}: {baseline_outcome or 'not measured'}")
            continue
        ax.scatter([p[0] / scale], [p[1]], marker="*", s=180, c="tab:red", edgecolors="black", zorder=4)
        ax.annotate(
            name,
            (p[0] / scale, p[1]),
            textcoords="offset points",
            xytext=(6, -12),
            fontsize=9,
            fontweight="bold",
            color="tab:red",
        )
    if base_pts:
        label = "baselines" + (f" ({'; '.join(missing)})" if missing else "")
        ax.scatter([], [], marker="*", s=120, c="tab:red", edgecolors="black", label=label)
