"""Cost model and exact solver: predicted peak memory and step time of any policy, and the best
policy for a memory budget.

API::

    Planner(profile, free_grads_at_batch_start=None)
    Planner.predict(policy, micro_batch=None) -> Prediction
    Planner.solve(budget_bytes, modes=None, micro_batch=None) -> PlannedPolicy  # BudgetError if impossible
    Planner.pareto_front(modes=None, micro_batch=None) -> list[PlannedPolicy]  # peak ascending
    Planner.min_peak(modes=None, micro_batch=None) -> int
    format_front(plans, budgets=None) -> str
    plan_seeds(recipe, space, budget_bytes) -> PlannerSeeds   # what the tuning session seeds

The model
---------
A `lightning_recompute.profile.Profile` cuts the step into segments (fixed ones, and a forward and a backward
segment per layer and mode), each with a level change ``delta`` and a transient ``peak`` above its
starting level. The predicted memory timeline of a policy walks the segments in order::

    level = base
    fixed segment:      candidate = level + peak;        level += delta
    forward of layer i:  candidate = level + f_i(m);      level += a_i(m)
    backward of layer i: candidate = level + b_i(m);      level += net_i - a_i(m)
    predicted peak = the largest candidate

where ``a_i(m)`` is what layer ``i`` keeps in mode ``m`` (its output included), ``f_i``/``b_i`` the
transients of its forward and backward (the latter includes recomputation), and ``net_i`` the bytes
its forward and backward leave behind (its gradients, output minus input), which does not depend
on the mode. The step time is the sum of the segments' times. This captures the peak's structure:
during layer ``i``'s backward, the activations of layers ``0..i`` are still held, layers after it
have been replaced by their gradients, and the layer's own recomputation sits on top.

Gradients in the forward: in Lightning's order the previous step's gradients are alive until
``zero_grad`` (after ``training_step``), so through the whole forward. `RecomputeCallback` frees
them at batch start where that cannot change training; the planner predicts whichever the profile
says the job does (`Profile.free_grads_at_batch_start`, or ``Planner(profile,
free_grads_at_batch_start=...)``): freed, ``base`` drops by the gradient bytes the profile saw
``zero_grad`` free (its own segment, ``fixed:loss->zero_grad``), and that segment frees nothing.
Every level before it drops by those bytes and none after, so the peak drops by them exactly
when it is in the forward, and by less (or nothing) when the backward's is close.

Micro-batch scaling (``micro_batch`` != the profiled one, factor ``k``): the activation part of every
segment (its delta and peak minus the parameter gradients it allocates) and its time scale by
``k``; parameters, gradients, optimizer state and the optimizer step do not. This assumes
activations are linear in the batch (true for transformers at fixed sequence length) and that a
segment's transient peak happens after its gradients exist; profile at the batch you will run
for figures that are exact rather than scaled.
A segment's ``static_delta`` / ``static_peak`` (what `lightning_recompute.planner.sharding` adds for one rank of
a sharded run: gathered parameters, all-gather and reduce-scatter buffers) do not scale either.

The solver
----------
Walking the timeline symbolically, every candidate above is ``c + A_p + term(m_i)``: a constant,
plus ``A_p = a_0(m_0) + ... + a_{p-1}(m_{p-1})`` (a prefix sum of kept bytes; in forward ``p`` is
the current layer, in the backward of layer ``i`` it is ``i + 1``, because the layers after ``i``
only contribute their mode-independent ``net``), plus a term of the current layer's mode. So every
constraint is non-decreasing in the prefix sum ``A``, and a partial policy over layers ``0..i-1``
with kept bytes ``A`` and time ``T`` dominates one with ``A' >= A`` and ``T' >= T``: any completion
of the second is feasible for the first and no faster. The dynamic programme keeps, layer by
layer, only the non-dominated ``(A, T)`` states that satisfy every constraint seen so far; it is
the multiple-choice knapsack over layers with the peak handled exactly, and it returns the same
optimum as enumerating all ``modes ** layers`` policies (tests check this against brute force).
The Pareto front adds the running maximum ``P`` of the candidates to the state and keeps the
non-dominated ``(A, P, T)``. Ties are broken deterministically: fastest, then least memory, then
modes earlier in ``none, selective, full, offload`` order.

Modules: `lightning_recompute.planner.solver` (the cost model, `Planner`, `Prediction`, `PlannedPolicy`),
`lightning_recompute.planner.report` (`format_front`), `tuner._search.planner_seeds` (the planner's seeds and
predictions for a tuning session), `lightning_recompute.planner.sharding` (`shard_profile`: the profile one rank
of DDP / FSDP / FSDP2 sees at a world size).
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

__all__ = [
    "BudgetError",
    "LayerPrediction",
    "PlannedPolicy",
    "Planner",
    "PlannerError",
    "Prediction",
    "format_front",
]
