"""The Optuna study, one per recipe and hardware in the recipe's storage, so a stopped session resumes and
several workers share the work; only the parent process asks and tells, and reports read the trials' user
attributes back, so they cover every worker."""

from __future__ import annotations

from tuner._search.lease import GateLeaseTimeout, gate_lease
from tuner._search.space import LayerInfo, SearchSpace, Seed, baseline_seeds, inspect_layers
from tuner._search.study import (
    FAR_OVER_BUDGET,
    Proposal,
    TrialRecord,
    TuningStudy,
    best_of,
    far_over_budget,
    study_name,
)

__all__ = [
    "FAR_OVER_BUDGET",
    "GateLeaseTimeout",
    "LayerInfo",
    "Proposal",
    "SearchSpace",
    "Seed",
    "TrialRecord",
    "TuningStudy",
    "baseline_seeds",
    "best_of",
    "far_over_budget",
    "gate_lease",
    "inspect_layers",
    "study_name",
]
