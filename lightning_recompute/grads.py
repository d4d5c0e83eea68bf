"""Freeing the previous step's gradients at batch start, where that cannot change training: Lightning zeroes them
after ``training_step``, so they stay alive through the forward (docs/PLUGIN.md, 'Gradients freed at batch start').
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import lightning as L
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_recompute.errors import RecomputeError

FLAG = "free_grads_at_batch_start"

# Lightning callbacks known to read no gradient in on_train_batch_start.
_SAFE_BATCH_START = frozenset({"LearningRateMonitor", "DeviceStatsMonitor"})


@dataclass(frozen=True)
class GradFreeing:
    """Whether the callback frees the gradients at batch start, and why."""

    enabled: bool
    reason: str

    def describe(self) -> str:
        return f"RecomputeCallback: freeing gradients at batch start: {'on' if self.enabled else 'off'} ({self.reason})"


def module_blockers(module: L.LightningModule, accumulate_grad_batches: int = 1) -> tuple[list[str], list[str]]:
    """What stands against freeing: ``(hard, soft)``, hard would change training, soft (a user hook that might
    read the gradients) the flag ``True`` overrides."""
    hard: list[str] = []
    soft: list[str] = []
    if not module.automatic_optimization:
        hard.append("manual optimisation: the module zeroes its gradients itself, whenever it chooses")
    if accumulate_grad_batches > 1:
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
    """Whether ``callback`` frees gradients at batch start; `RecomputeError` when ``flag`` is ``True`` where freeing
    would change training."""
    if flag is False:
        return GradFreeing(False, f"{FLAG}=False")
    hard, soft = module_blockers(module, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
    if type(trainer.strategy).__name__ == "DeepSpeedStrategy":
        hard.append("DeepSpeedStrategy: its engine keeps and zeroes gradients in its own partitioned buffers")
    callbacks: list[L.Callback] = list(getattr(trainer, "callbacks", []))
    after = callbacks[callbacks.index(callback) + 1 :] if callback in callbacks else []
    soft += [
        f"callback {type(cb).__name__}.on_before_zero_grad may read the gradients"
        for cb in callbacks
        if cb is not callback and is_overridden("on_before_zero_grad", cb, parent=L.Callback)
    ]
    soft += [
        f"callback {type(cb).__name__}.on_train_batch_start runs after this one and may read the gradients"
        for cb in after
        if type(cb).__name__ not in _SAFE_BATCH_START and is_overridden("on_train_batch_start", cb, parent=L.Callback)
    ]
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
    """Set the gradients of ``optimizers``' parameters to ``None``, as Lightning's ``zero_grad`` does."""
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
