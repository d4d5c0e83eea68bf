"""`Planner`: a profile's cost model (each policy's predicted peak and step time, walking the step's segments in
order) and exact solvers, a dynamic programme over layers keeping the non-dominated (kept bytes, time) states."""

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
