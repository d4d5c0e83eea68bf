"""The Optuna study: its name, the search space, seeding, constraints, ask/tell.

One study per recipe and hardware, in the recipe's storage, so a stopped session resumes and several workers
share the work. The parent process owns every trial: it asks for a candidate (`TuningStudy.ask`), decides
whether to run it (not a duplicate, not predicted far over budget) and tells Optuna what happened; reports are
read back from the trials' user attributes, so they cover every worker. Alike layers are searched as counts per
mode plus a placement; unlike layers each get a choice (`tuner._search.space`).
"""

from __future__ import annotations

from tuner._search.lease import GateLeaseTimeout, gate_lease
from tuner._search.seeds import BASELINES, Seed, baseline_seeds
from tuner._search.space import PLACEMENTS, LayerInfo, SearchSpace, inspect_layers
from tuner._search.study import (
    CONSTRAINT,
    FAR_OVER_BUDGET,
    Predictor,
    Proposal,
    RecordOutcome,
    TrialRecord,
    TuningStudy,
    best_of,
    far_over_budget,
    peak_constraint,
    study_name,
)

__all__ = [
    "BASELINES",
    "CONSTRAINT",
    "FAR_OVER_BUDGET",
    "PLACEMENTS",
    "GateLeaseTimeout",
    "LayerInfo",
    "Predictor",
    "Proposal",
    "RecordOutcome",
    "SearchSpace",
    "Seed",
    "TrialRecord",
    "TuningStudy",
    "baseline_seeds",
    "best_of",
    "far_over_budget",
    "gate_lease",
    "inspect_layers",
    "peak_constraint",
    "study_name",
]
