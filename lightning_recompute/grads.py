"""Freeing the previous step's gradients at batch start: when that cannot change training, and doing it.

Lightning's automatic optimisation runs ``training_step``, then ``optimizer.zero_grad()`` (which
sets every gradient to ``None``), then ``backward`` (see
``lightning.pytorch.loops.optimization.automatic.Closure.closure``). So the previous step's
gradients stay allocated through the whole forward, exactly when activations pile up: with
bf16-mixed training that is 4 bytes per parameter (fp32 gradients). Setting them to ``None`` at
batch start, with the same ``optimizer.zero_grad(set_to_none=True)`` call, frees that memory for
the forward, and training computes the same thing, provided nothing reads the gradients between
this batch's start and Lightning's own ``zero_grad``. `decide_grad_freeing` checks what can be
checked (the loop's settings and which hooks are overridden); `free_gradients` does it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import lightning as L
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_recompute.errors import RecomputeError

__all__ = ["GradFreeing", "decide_grad_freeing", "free_gradients", "module_blockers"]

FLAG = "free_grads_at_batch_start"
"""The `RecomputeCallback` argument that turns it on or off (``None``: on where safe)."""

# Lightning callbacks known to read no gradient in on_train_batch_start (they log learning rates
# and device statistics); any other callback running that hook after this one might.
_SAFE_BATCH_START = frozenset({"LearningRateMonitor", "DeviceStatsMonitor"})


@dataclass(frozen=True)
class GradFreeing:
    """Whether the callback frees the gradients at batch start, and why."""

    enabled: bool
    reason: str

    def describe(self) -> str:
        """The line the callback logs at fit start."""
        return f"RecomputeCallback: freeing gradients at batch start: {'on' if self.enabled else 'off'} ({self.reason})"


def module_blockers(module: L.LightningModule, accumulate_grad_batches: int = 1) -> tuple[list[str], list[str]]:
    """What in ``module`` (and the accumulation setting) stands against freeing: ``(hard, soft)``.

    Hard: freeing would change training (no ``True`` flag can override them). Soft: a hook that
    runs between batch start and Lightning's ``zero_grad`` is the user's, and might read the
    gradients; the flag ``True`` says it does not. The tuner calls this without a Trainer to know
    what its trials' callback will do.
    """
    hard: list[str] = []
    soft: list[str] = []
    if not module.automatic_optimization:
        hard.append("manual optimisation: the module zeroes its gradients itself, whenever it chooses")
    if accumulate_grad_batches > 1:
        # Lightning zeroes only at the first micro-batch of a window (batch_idx % N == 0), after its
        # training_step: freeing there would be safe, but every later micro-batch of the window runs
        # its forward with the accumulating gradients alive anyway, so the step's peak would not drop;
        # and a window cut short at an epoch's end makes "the first micro-batch" harder to be sure of.
        hard.append(
            f"accumulate_grad_batches={accumulate_grad_batches}: gradients accumulate across micro-batches, "
            f"so they are alive in the forward of every micro-batch but the first"
        )
    if is_overridden("optimizer_zero_grad", module):
        hard.append(
            f"{type(module).__name__} overrides optimizer_zero_grad, which may keep or zero gradients its own way"
        )
    for hook in ("on_before_zero_grad", "on_train_batch_start"):
        if is_overridden(hook, module):
            soft.append(f"{type(module).__name__}.{hook} runs before Lightning's zero_grad and may read the gradients")
    return hard, soft


def decide_grad_freeing(
    flag: bool | None, trainer: L.Trainer, module: L.LightningModule, callback: L.Callback
) -> GradFreeing:
    """Whether ``callback`` frees gradients at batch start under ``trainer``, given its flag.

    ``flag`` ``False``: off. ``None``: on when nothing stands against it. ``True``: on even when a
    user hook that runs before ``zero_grad`` is overridden (the user vouches it reads no gradients).

    Raises:
        RecomputeError: ``flag`` is ``True`` where freeing would change training (manual
            optimisation, gradient accumulation, an overridden ``optimizer_zero_grad``, DeepSpeed).
    """
    if flag is False:
        return GradFreeing(False, f"{FLAG}=False")
    hard, soft = module_blockers(module, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
    strategy = type(trainer.strategy).__name__
    if strategy == "DeepSpeedStrategy":
        hard.append("DeepSpeedStrategy: its engine keeps and zeroes gradients in its own partitioned buffers")
    # The connector assigns Trainer.callbacks at run time; Lightning's stubs do not declare it.
    callbacks: list[L.Callback] = list(getattr(trainer, "callbacks", []))
    after = callbacks[callbacks.index(callback) + 1 :] if callback in callbacks else []
    for cb in callbacks:
        if cb is not callback and is_overridden("on_before_zero_grad", cb, parent=L.Callback):
            soft.append(f"callback {type(cb).__name__}.on_before_zero_grad may read the gradients")
    for cb in after:
        if type(cb).__name__ not in _SAFE_BATCH_START and is_overridden("on_train_batch_start", cb, parent=L.Callback):
            soft.append(
                f"callback {type(cb).__name__}.on_train_batch_start runs after this one and may read the gradients"
            )
    if hard:
        if flag:
            raise RecomputeError(
                f"{FLAG}=True, but freeing the gradients at batch start would change training here: "
                f"{'; '.join(hard)}. Pass {FLAG}=None (on where safe) or False."
            )
        return GradFreeing(False, "; ".join(hard))
    if soft:
        if flag:
            return GradFreeing(True, f"{FLAG}=True, though {'; '.join(soft)}")
        return GradFreeing(False, f"{'; '.join(soft)}; pass {FLAG}=True if it does not")
    return GradFreeing(
        True,
        "automatic optimisation, no gradient accumulation: Lightning sets them to None before backward anyway",
    )


def free_gradients(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Set the gradients of ``optimizers``' parameters to ``None``: the call Lightning's ``zero_grad`` makes.

    Only the optimizers' parameters: a parameter no optimizer holds is never zeroed by Lightning
    either, so its gradient must keep accumulating.
    """
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
