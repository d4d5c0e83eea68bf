"""The longest sequence length that fits a memory budget, per policy family (`longest_fits`): each probed length
is profiled (once, for every family) and planned exactly; a family's least peak never falls as the sequence
grows, so "fits" flips once and is bisected."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_recompute.planner.solver import PlannedPolicy, Planner, PlannerError
from lightning_recompute.policy import RecomputePolicy
from lightning_recompute.profile import Profile

BEST_MIXED = "best mixed"  # every per-layer mix of the searched modes: the planner's fastest that fits


@dataclass(frozen=True)
class SeqLenFit:
    """The longest sequence length at which one policy family fits the budget."""

    family: str
    seq_len: int | None  # the longest multiple of the step that fits; None: not even one step
    plan: PlannedPolicy | None
    capped: bool = False  # it still fits at the largest length searched (seq_len is that cap, not the limit)

    @property
    def tokens_per_s(self) -> float | None:
        if self.plan is None or self.seq_len is None or self.plan.step_time_s <= 0:
            return None
        return self.plan.prediction.micro_batch * self.seq_len / self.plan.step_time_s


def longest_fits(
    profile_at: Callable[[int], Profile], limit: int, *, modes: Sequence[str], start: int, step: int, cap: int
) -> list[SeqLenFit]:
    """For each mode of ``modes`` (every layer in it) and `BEST_MIXED`, the longest multiple of ``step`` up to
    ``cap`` that fits ``limit`` bytes; `PlannerError` when ``step``, ``start`` or ``cap`` is not a length."""
    for name, value in (("step", step), ("start", start), ("cap", cap)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlannerError(f"{name}: must be a positive sequence length, got {value!r}")
    if cap < step:
        raise PlannerError(f"cap: {cap} is below the step {step}; nothing to search")

    @functools.cache
    def planner_at(units: int) -> Planner:
        return Planner(profile_at(units * step))

    top = cap // step
    first = min(max(1, round(start / step)), top)
    out = []
    for family in [*modes, BEST_MIXED]:

        @functools.cache
        def plan(units: int, family: str = family) -> PlannedPolicy | None:
            """``family``'s policy at ``units`` steps when it fits ``limit``, else ``None``."""
            planner = planner_at(units)
            if family == BEST_MIXED:
                return None if planner.min_peak(modes) > limit else planner.solve(limit, modes=modes)
            mapping = dict.fromkeys(planner.names, family)
            fit = PlannedPolicy(RecomputePolicy.from_modes(mapping), mapping, planner.predict(mapping))
            return fit if fit.peak_bytes <= limit else None

        # From the start: double (or halve) until a bracket lo (fits, or 0) < hi (does not fit, or top + 1)
        # is found, then bisect it.
        lo, hi, probe = 0, top + 1, first
        while hi - lo > 1:
            if plan(probe) is not None:
                lo = probe
            else:
                hi = probe
            if hi > top:  # nothing too long yet
                probe = min(2 * probe, top)
            elif lo == 0:  # nothing fits yet
                probe //= 2
            else:
                probe = (lo + hi) // 2
        out.append(SeqLenFit(family, lo * step or None, plan(lo) if lo else None, capped=lo == top))
    return out
