"""Who races after a search: the leading trials, the planner's pick, the baselines and the good policy.

A race is only as good as its field. The leaders by single trials are there because the search
thinks they are fast; the planner's pick and its top predictions because a single trial can rank a
fast policy low (one measurement under load), and the planner's view is independent of that noise;
a trial far from its prediction while its neighbours agree is suspect (the race measures it again
rather than trusting either); the fastest
fitting baseline and ``full`` because the user's "vs" figures are about them; the current good
policy so that keeping it is decided by the same race.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lightning_recompute.policy import RecomputePolicy
from tuner.recipe.schema import PREDICTION_SPAN

if TYPE_CHECKING:
    from tuner.search import TrialRecord
    from tuner.tracking import GoodPolicy

__all__ = ["PREDICTION_SPAN", "Field", "choose_field", "suspects"]


@dataclass
class Field:
    """The entrants of a race and the references of its "vs" figures, or why there is no race."""

    entrants: list[tuple[RecomputePolicy, list[str]]] = field(default_factory=list)
    """``(policy, labels)`` in order of entry (the leader by trial first)."""
    references: list[RecomputePolicy] = field(default_factory=list)
    """The baselines the winner is compared with."""
    micro_batch: int | None = None
    """The micro-batch every entrant runs at (the best trial's)."""
    skipped: str | None = None
    """Why no race is run (``None``: race)."""
    notes: list[str] = field(default_factory=list)
    """Candidates left out, and why."""

    def has(self, fingerprint: str) -> bool:
        """Whether a policy of this fingerprint is already an entrant."""
        return any(p.fingerprint() == fingerprint for p, _ in self.entrants)

    def add(self, policy: RecomputePolicy, label: str) -> None:
        for existing, labels in self.entrants:
            if existing.fingerprint() == policy.fingerprint():
                if label not in labels:
                    labels.append(label)
                return
        self.entrants.append((policy, [label]))


def choose_field(
    records: Sequence[TrialRecord],
    best: TrialRecord,
    good: GoodPolicy | None,
    *,
    leaders: int,
    budget_bytes: int | None,
    predicted: int = 0,
) -> Field:
    """The race's field after a search whose best feasible trial is ``best``.

    ``leaders``: how many of the fastest fitting trials race; ``predicted``: how many more race from
    those the planner predicts fastest (`PREDICTION_SPAN`), fastest trial first.

    Entrants run at ``best``'s micro-batch (one model, one data stream); trials at another one are
    left out and say so. Compiled policies are left out: switching a compiled layer's policy
    recompiles it, which would be timed as the policy's cost (their trials' figures stand, and say
    they are single runs). With ``best`` compiled there is no race.
    """
    out = Field(micro_batch=best.micro_batch)
    if best.policy is None:
        out.skipped = f"trial {best.number} holds no policy"
        return out
    if best.policy.compile:
        out.skipped = (
            "the best trial compiles its layers, and switching a compiled layer's policy recompiles it: "
            "not raced, its figure is a single run"
        )
        return out
    fitting = [r for r in records if r.feasible and r.measured and r.policy is not None and r.throughput]
    fitting.sort(key=lambda r: (-(r.throughput or 0.0), r.number))
    left_compiled = left_batch = 0
    taken = 0
    for r in fitting:
        assert r.policy is not None
        if r.policy.compile:
            left_compiled += 1
            continue
        if r.micro_batch != best.micro_batch:
            left_batch += 1
            continue
        if taken < leaders and not out.has(r.fingerprint):
            out.add(r.policy, f"trial {r.number}")
            taken += 1
    same = [r for r in fitting if r.micro_batch == best.micro_batch and r.policy is not None and not r.policy.compile]
    _add_references(out, same)
    if good is not None:
        _add_good(out, good, best, budget_bytes)
    _add_predicted(out, same, predicted)  # last: the planner's pick, a baseline or the good policy is no extra
    if left_compiled:
        out.notes.append(f"{left_compiled} compiled trial(s) not raced (switching a compiled layer recompiles it)")
    if left_batch:
        out.notes.append(f"{left_batch} trial(s) at another micro-batch than the best not raced")
    if len(out.entrants) < 2:
        out.skipped = "only one candidate fits: nothing to race"
    return out


def _add_predicted(out: Field, same: Sequence[TrialRecord], count: int) -> None:
    """Up to ``count`` trials of ``same`` (fitting, at the best's micro-batch) not yet in the field, from
    those the planner predicts within `PREDICTION_SPAN` of its fastest prediction, fastest trial first.

    Why: in `bench/decision_quality.py`'s ``wide4`` most promotions short of the best came from races
    the best policy was not in; its single trial had ranked it below the leaders, while the planner
    predicted it among the fastest. Policies predicted slower than that span do not enter this way.
    """

    rated = [
        (r, p)
        for r in same
        if r.policy is not None and (p := r.predicted_step_time_s) is not None and math.isfinite(p) and p > 0
    ]
    if count <= 0 or not rated:
        return
    top = min(p for _, p in rated) * (1.0 + PREDICTION_SPAN)
    near = [r for r, p in rated if p <= top and not out.has(r.fingerprint)]
    for r in sorted(near, key=lambda r: (-(r.throughput or 0.0), r.number))[:count]:
        assert r.policy is not None
        out.add(r.policy, "planner prediction")


def _add_references(out: Field, same: Sequence[TrialRecord]) -> None:
    """The planner's pick and the baselines beside the leaders: the fastest baseline and full, the
    references the winner's figure is given against (``same``: fitting trials at the best's micro-batch,
    fastest first)."""
    planner = [r for r in same if (r.seed or "").startswith("planner:budget")]
    if planner and planner[0].policy is not None:
        out.add(planner[0].policy, "planner")
    baselines = [r for r in same if (r.seed or "").startswith("baseline:")]
    if baselines and (fastest := baselines[0].policy) is not None:  # `same` is sorted fastest first
        out.add(fastest, f"baseline {_name(baselines[0])}")
        out.references.append(fastest)
    full = next((r for r in same if r.seed == "baseline:full"), None)
    if (
        full is not None
        and full.policy is not None
        and all(p.fingerprint() != full.fingerprint for p in out.references)
    ):
        out.add(full.policy, "baseline full")
        out.references.append(full.policy)


def _add_good(out: Field, good: GoodPolicy, best: TrialRecord, budget_bytes: int | None) -> None:
    """The current good policy as an entrant, unless it cannot race (over the limit, another micro-batch,
    compiled); a note says why not."""
    fits = budget_bytes is None or good.peak_bytes is None or good.peak_bytes <= budget_bytes
    if not fits:
        out.notes.append("the current good policy is over the budget limit: not raced")
    elif good.micro_batch != best.micro_batch:
        out.notes.append("the current good policy was tuned at another micro-batch: not raced")
    elif good.policy.compile:
        out.notes.append("the current good policy compiles its layers: not raced")
    else:
        out.add(good.policy, "good")


def _name(record: TrialRecord) -> str:
    return (record.seed or "").removeprefix("baseline:")


def suspects(records: Sequence[TrialRecord], *, tolerance: float = 0.25) -> list[tuple[TrialRecord, str]]:
    """Trials far from the planner's prediction while the others are close: a measurement to distrust.

    Each measured trial with a predicted step time has a ratio measured / predicted. The planner's
    times are off by a factor on any machine, so the ratio is judged against the median ratio of all
    trials: a trial more than ``tolerance`` (relative) away from it, while the typical trial is within
    ``tolerance`` of it, is suspect. Needs at least 4 trials with predictions.
    """
    rated = [
        (r, r.step_time_s / r.predicted_step_time_s)
        for r in records
        if r.measured and r.step_time_s and r.predicted_step_time_s
    ]
    if len(rated) < 4:
        return []
    mid = statistics.median(q for _, q in rated)
    typical = statistics.median(abs(q / mid - 1.0) for _, q in rated)
    if typical > tolerance:
        return []  # the planner is far off everywhere: no trial stands out
    found = []
    for r, q in rated:
        off = q / mid - 1.0
        if abs(off) > tolerance:
            found.append(
                (
                    r,
                    f"trial {r.number} ({r.short}) measured {r.step_time_s:.4g} s/step against the planner's "
                    f"{r.predicted_step_time_s:.4g} s: {off:+.0%} from how far the other trials are from theirs "
                    f"(typically {typical:.0%}); suspect, re-measured in the race",
                )
            )
    return found
