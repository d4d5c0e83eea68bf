"""Who races after a search (the field) and which policy the gate gets (the candidate); the session runs the
race and the gate (`tuner.session`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lightning_recompute.errors import RecomputeError
from lightning_recompute.policy import RecomputePolicy
from tuner._gate import Candidate
from tuner._search.space import Source, pick_of
from tuner.recipe._schema import PREDICTION_SPAN

if TYPE_CHECKING:
    from lightning_recompute.race import RaceResult
    from tuner._search import TrialRecord
    from tuner._tracking import GoodPolicy

__all__ = ["Field", "candidate_of", "choose_field"]


def candidate_of(
    best: TrialRecord,
    race: RaceResult | None,
    good: GoodPolicy | None,
    records: Sequence[TrialRecord],
    layer_names: tuple[str, ...],
) -> Candidate:
    """The gate's candidate: the race's winner, or without one the best single trial."""
    policy, source = best.policy, best.run_id
    if race is not None and race.ok:
        won = next((r for r in records if r.ran and r.fingerprint == race.winner), None)
        if won is not None:
            policy, source = won.policy, won.run_id
        elif good is not None and good.fingerprint == race.winner:
            policy, source = good.policy, good.run_id
    if policy is None:
        raise RecomputeError(f"trial {best.number}: the study's record holds no policy to gate")
    return Candidate(policy=policy, micro_batch=best.micro_batch, source_run_id=source, layer_names=layer_names)


@dataclass
class Field:
    """Who races (the leading trials, the planner's pick and top predictions, the fastest fitting baseline and
    full, the good policy) and the references of the "vs" figures, or why there is no race."""

    entrants: list[tuple[RecomputePolicy, list[str]]] = field(default_factory=list)  # (policy, labels), leader first
    references: list[RecomputePolicy] = field(default_factory=list)  # the baselines the winner is compared with
    micro_batch: int | None = None  # the micro-batch every entrant runs at (the best trial's)
    skipped: str | None = None  # why no race is run (None: race)
    notes: list[str] = field(default_factory=list)  # candidates left out, and why

    def has(self, fingerprint: str) -> bool:
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
    """The ``leaders`` fastest fitting trials and ``predicted`` more the planner predicts within `PREDICTION_SPAN` of
    its fastest, so that a best policy one unlucky trial ranked low still races (`bench/decision_quality.py`)."""
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
    plain = [r for r in fitting if r.policy is not None and not r.policy.compile]
    # `same`: fitting trials at the best's micro-batch, fastest first; the leaders race, one per policy.
    same = [r for r in plain if r.micro_batch == best.micro_batch]
    leading: dict[str, RecomputePolicy] = {}
    for r in same:
        if r.policy is not None and len(leading) < leaders and r.fingerprint not in leading:
            leading[r.fingerprint] = r.policy
            out.add(r.policy, f"trial {r.number}")
    # The planner's pick, and the fastest baseline and full as the references of the winner's figures.
    planner = [r for r in same if r.source is Source.PLANNER and pick_of(r.label).startswith("budget")]
    if planner and planner[0].policy is not None:
        out.add(planner[0].policy, "planner")
    baselines = [r for r in same if r.baseline is not None]
    if baselines and (fastest := baselines[0].policy) is not None:
        out.add(fastest, f"baseline {baselines[0].baseline or ''}")
        out.references.append(fastest)
    full = next((r for r in same if r.baseline == "full"), None)
    if (
        full is not None
        and full.policy is not None
        and all(p.fingerprint() != full.fingerprint for p in out.references)
    ):
        out.add(full.policy, "baseline full")
        out.references.append(full.policy)
    if good is not None:
        if budget_bytes is not None and good.peak_bytes is not None and good.peak_bytes > budget_bytes:
            out.notes.append("the current good policy is over the budget limit: not raced")
        elif good.micro_batch != best.micro_batch:
            out.notes.append("the current good policy was tuned at another micro-batch: not raced")
        elif good.policy.compile:
            out.notes.append("the current good policy compiles its layers: not raced")
        else:
            out.add(good.policy, "good")
    # Last: the planner's pick, a baseline or the good policy is no extra.
    rated = [(r, p) for r in same if (p := r.predicted_step_time_s) is not None and math.isfinite(p) and p > 0]
    if predicted > 0 and rated:
        top = min(p for _, p in rated) * (1.0 + PREDICTION_SPAN)
        near = [r for r, p in rated if p <= top and r.policy is not None and not out.has(r.fingerprint)]
        for r in near[:predicted]:  # `same` is sorted fastest first
            assert r.policy is not None
            out.add(r.policy, "planner prediction")
    if len(fitting) > len(plain):
        out.notes.append(
            f"{len(fitting) - len(plain)} compiled trial(s) not raced (switching a compiled layer recompiles it)"
        )
    if len(plain) > len(same):
        out.notes.append(f"{len(plain) - len(same)} trial(s) at another micro-batch than the best not raced")
    if len(out.entrants) < 2:
        out.skipped = "only one candidate fits: nothing to race"
    return out
