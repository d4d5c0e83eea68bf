"""Running an optimizer step again after an out-of-memory error in it, as if the first try never happened.

Lightning runs a step's forward and backward inside the closure it hands to the module's
``optimizer_step``. `StepRetry` wraps that method: when the closure raises ``torch.OutOfMemoryError``,
it asks its owner what to run instead (`AutoRecompute` drops the candidate and puts the safest one
left on), drops the half-made gradients, frees the cached blocks, sets the random number generators
and the module's buffers (BatchNorm's statistics, which the failed forward may have updated) back to
where they were when the step began, and calls the same closure again: the same batch, the
same dropout masks, the step a plain run takes. An out-of-memory error in the optimizer's update,
after the closure, is not run again: some parameters may be updated already.

Written here rather than taken from a library: Lightning has no hook that sees an exception inside
a step and may retry it (``on_exception`` ends the fit).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import lightning as L
import torch

__all__ = ["StepRetry", "StepStart"]


class StepStart:
    """What a step changes besides parameters, at its start: the CPU generator's state, the module's CUDA
    device's when it has one, and a copy of the module's buffers (none for most transformers)."""

    def __init__(self, module: torch.nn.Module) -> None:
        device = module.device if isinstance(module, L.LightningModule) else torch.device("cpu")
        self.cpu = torch.get_rng_state()
        self.device = device if device.type == "cuda" else None
        self.cuda = torch.cuda.get_rng_state(device) if self.device is not None else None
        self.buffers = [(b, b.detach().clone()) for b in module.buffers()]

    def restore(self) -> None:
        """Put the generators and the buffers back to this state."""
        torch.set_rng_state(self.cpu)
        if self.device is not None and self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        with torch.no_grad():
            for live, before in self.buffers:
                live.copy_(before)


class StepRetry:
    """Wraps ``pl_module.optimizer_step`` so that an out-of-memory error in a step's closure can be retried.

    Args:
        on_oom: called with the error when the closure ran out of memory; switches what the step runs
            under and returns ``True`` to run it again, ``False`` to let the error stand.
    """

    def __init__(self, on_oom: Callable[[BaseException], bool]) -> None:
        self.on_oom = on_oom
        self.start: StepStart | None = None
        """The random state and buffers at the start of the current optimizer step (`mark`)."""
        self.retried = 0
        """Steps run again so far."""
        self._module: L.LightningModule | None = None

    def mark(self, module: torch.nn.Module) -> None:
        """Remember the random state and buffers at the start of each optimizer step (its first micro-batch)."""
        self.start = StepStart(module)

    def install(self, pl_module: L.LightningModule) -> None:
        """Wrap the module's ``optimizer_step`` (an instance attribute shadowing the method; `remove` undoes it)."""
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
            # Out of the except block: the error's traceback holds the failed step's frames, and with them
            # its activations, until the block ends; the step runs again only once they are freed.
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
        """Give the module its own ``optimizer_step`` back."""
        if self._module is not None:
            self._module.__dict__.pop("optimizer_step", None)
            self._module = None
