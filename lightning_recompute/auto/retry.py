"""Running an optimizer step again after an out-of-memory error in its closure, as if the first try never happened.

`StepRetry` wraps ``optimizer_step`` (Lightning has no hook that may retry a step): the gradients are dropped,
the cache freed, random generators and buffers set back to the step's start, and the same closure runs again.
An error in the optimizer's update, after the closure, is not retried. See docs/AUTO.md.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import lightning as L
import torch

__all__ = ["StepRetry", "StepStart"]


class StepStart:
    """What a step changes besides parameters, at its start: random generator states and a copy of the buffers."""

    def __init__(self, module: torch.nn.Module) -> None:
        device = module.device if isinstance(module, L.LightningModule) else torch.device("cpu")
        self.cpu = torch.get_rng_state()
        self.device = device if device.type == "cuda" else None
        self.cuda = torch.cuda.get_rng_state(device) if self.device is not None else None
        self.buffers = [(b, b.detach().clone()) for b in module.buffers()]

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None and self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        with torch.no_grad():
            for live, before in self.buffers:
                live.copy_(before)


class StepRetry:
    """Wraps ``pl_module.optimizer_step`` so that an out-of-memory error in a step's closure can be retried.

    Args:
        on_oom: called with the error; switches what the step runs under and returns whether to run it again.
    """

    def __init__(self, on_oom: Callable[[BaseException], bool]) -> None:
        self.on_oom = on_oom
        self.start: StepStart | None = None
        self.retried = 0
        self._module: L.LightningModule | None = None

    def mark(self, module: torch.nn.Module) -> None:
        """Remember the random state and buffers at the start of each optimizer step."""
        self.start = StepStart(module)

    def install(self, pl_module: L.LightningModule) -> None:
        """Wrap the module's ``optimizer_step`` (an instance attribute; `remove` undoes it)."""
        original = pl_module.optimizer_step
        retry = self

        def guarded(epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> Any:
            ran: list[bool] = []

            def closure() -> Any:
                out = optimizer_closure()
                ran.append(True)
                return out

            try:
                return original(epoch, batch_idx, optimizer, closure if optimizer_closure is not None else None)
            except torch.OutOfMemoryError as err:
                if ran or retry.start is None or not retry.on_oom(err):
                    raise
            # Out of the except block, whose traceback holds the failed step's activations.
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            assert retry.start is not None
            retry.start.restore()
            retry.retried += 1
            return original(epoch, batch_idx, optimizer, optimizer_closure)

        pl_module.__dict__["optimizer_step"] = guarded
        self._module = pl_module

    def remove(self) -> None:
        if self._module is not None:
            self._module.__dict__.pop("optimizer_step", None)
            self._module = None
