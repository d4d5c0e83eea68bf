"""Cost model and exact solver: predicted peak memory and step time of any policy, and the best policy for a budget.

The model: a `Profile` cuts the step into segments, each with a level change ``delta`` and a transient ``peak``
above its starting level; a policy's memory timeline walks them in order::

    level = base
    fixed segment:       candidate = level + peak;    level += delta
    forward of layer i:  candidate = level + f_i(m);  level += a_i(m)
    backward of layer i: candidate = level + b_i(m);  level += net_i - a_i(m)
    predicted peak = the largest candidate

``a_i(m)`` is what layer ``i`` keeps in mode ``m`` (output included), ``f_i``/``b_i`` its transients, ``net_i``
what its forward and backward leave behind (mode-independent); the step time is the sum of segment times.
Gradients freed at batch start lower every level before ``zero_grad``'s segment. At another micro-batch the
activation part of each segment scales linearly; gradients, optimizer state and ``static_*`` parts do not.

The solver: every candidate is ``c + A_p + term(m_i)`` with ``A_p`` the prefix sum of kept bytes, so a partial
policy with less ``A`` and less time dominates; a dynamic programme keeps the non-dominated ``(A, T)`` states
(``(A, P, T)`` for the Pareto front) and equals brute force. Ties: fastest, then least memory, then mode order.
"""

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
