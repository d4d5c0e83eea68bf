"""The planner's terminal table: a Pareto front (or any list of planned policies) with its budgets."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_recompute.modes import MODES
from lightning_recompute.planner.solver import PlannedPolicy
from lightning_recompute.profile import ALL_MODES
from lightning_recompute.units import format_bytes, format_seconds

_COUNT_NAMES = {s.name: s.label for s in MODES}


def _count_name(mode: str) -> str:
    """A mode's name in the mode-count header: ``sel`` for selective, the family alone for a family."""
    return _COUNT_NAMES.get(mode, mode.partition(":")[2] or mode)


def format_front(plans: Sequence[PlannedPolicy], budgets: Mapping[str, int] | None = None) -> str:
    """A terminal table of plans, with a column per named budget saying whether each fits."""
    if not plans:
        return "(no plans)"
    budgets = dict(budgets or {})
    fastest = min(p.step_time_s for p in plans)
    counts_head = "/".join(_count_name(mode) for mode in ALL_MODES)  # one name per count a row prints
    counts_w = len(counts_head)
    head = f"{'#':>3}  {'peak':>11}  {'step':>11}  {'vs fastest':>10}  {counts_head:>{counts_w}}"
    head += "".join(f"  {name:>{max(6, len(name))}}" for name in budgets) + "  layers"
    lines = [head, "-" * len(head)]
    for i, p in enumerate(plans):
        counts = [sum(1 for m in p.modes.values() if m == mode) for mode in ALL_MODES]
        row = (
            f"{i:>3}  {format_bytes(p.peak_bytes):>11}  {format_seconds(p.step_time_s):>11}  "
            f"{(p.step_time_s / fastest - 1) * 100:>+9.1f}%  {'/'.join(map(str, counts)):>{counts_w}}"
        )
        row += "".join(
            f"  {('fits' if p.peak_bytes <= b else '-'):>{max(6, len(name))}}" for name, b in budgets.items()
        )
        lines.append(row + "  " + p.short())
    if plans[0].prediction.estimated:
        lines.append("time: estimated from FLOPs and memory traffic against the hardware table, not measured")
    return "\n".join(lines)
