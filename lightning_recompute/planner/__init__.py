"""`Planner`: the predicted peak memory and step time of any policy from a `Profile`, and the exact best policy
for a budget (the cost model: `lightning_recompute.planner.solver`)."""

from __future__ import annotations

from lightning_recompute.planner.report import format_front
from lightning_recompute.planner.solver import (
    BudgetError,
    LayerPrediction,
    PlannedPolicy,
    Planner,
    PlannerError,
    Prediction,
)

__all__ = ["BudgetError", "LayerPrediction", "PlannedPolicy", "Planner", "PlannerError", "Prediction", "format_front"]
