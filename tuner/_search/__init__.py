"""The Optuna study: its name, the search space, seeding, constraints, ask/tell.

One study per recipe and hardware, kept in the recipe's storage, so a session that stops (Ctrl-C,
a crash, a finished ``n_trials``) resumes where it was, and several ``recompute-tune`` processes
against one storage share the work. The parent process owns every trial: it asks Optuna for a
candidate (`TuningStudy.ask`), decides whether to run it (a duplicate of a policy already
measured is not; one the planner predicts far over budget is not), and tells Optuna what
happened (`tell_result`, `tell_skipped`, `tell_duplicate`, `tell_interrupted`). Everything a
session later reports (the trials table, the best feasible trial, the baselines) is read back
from the trials' user attributes, so it covers every worker that shared the study.

The search space depends on the model: where every layer is alike (one class, same parameter
shapes), which layer gets which mode matters much less than *how many* do, so the space is a
count of layers per mode plus a placement (first / last / spread) from which the per-layer policy
is built deterministically. Where layers differ, each layer gets its own categorical choice.

Modules: `tuner._search.space` (layers and the space), `tuner._search.seeds` (baselines),
`tuner._search.study` (`TuningStudy`, its records and the skip rule), `tuner._search.setup_state`
(`StudySetup`: the study's setup shared by its workers), `tuner._search.study` (`InFlight`: running
trials, alive or reaped), `tuner._search.attrs` (the study's user-attribute keys), `tuner._search.lease`
(one evidence gate at a time per study).
Storage is opened by `tuner._stores`.
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
