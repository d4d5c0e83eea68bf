"""LightningModules that fail on purpose, for the trial tests (recipes point ``class_path`` here).

Each subclasses the reference GPT so recipes, layer discovery and the data module stay those of
a real run; only the failure is injected.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import torch
from torch import nn

from lightning_recompute.reference import ReferenceGPT


class RaisesOOM(ReferenceGPT):
    """Raises `torch.OutOfMemoryError` in the first training step, as CUDA's allocator does."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected by tests.tuner.faulty)")


class AllocatesTooMuch(ReferenceGPT):
    """Asks the CPU allocator for an exabyte: a genuine allocation failure, not a raised imitation."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        waste = torch.empty(1 << 60, dtype=torch.uint8)
        return waste.sum()


class RaisesError(ReferenceGPT):
    """Raises an ordinary exception in the first training step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        raise RuntimeError("injected failure from tests.tuner.faulty.RaisesError")


class Aborts(ReferenceGPT):
    """Kills its own interpreter with ``abort()`` (SIGABRT), like a crash in native code."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        print("Aborts: about to abort()", file=sys.stderr, flush=True)
        os.abort()


class Hangs(ReferenceGPT):
    """Never finishes its first training step; starts a child process that would outlive it.

    Writes ``"<own pid> <child pid>"`` to ``pid_file`` so a test can check both were killed.
    """

    def __init__(self, pid_file: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pid_file = pid_file

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        if self.pid_file:
            with open(self.pid_file + ".tmp", "w") as fh:
                fh.write(f"{os.getpid()} {child.pid}")
            os.replace(self.pid_file + ".tmp", self.pid_file)
        while True:
            time.sleep(0.5)


class _CountingBlockWrapper(nn.Module):
    """Scales its block's input by how often it has run: different on a recomputation."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        # Scaling the input (not the output) changes what the block saves for backward, so a
        # recomputation, which sees a different count, produces different gradients.
        return self.block(x * (1.0 + 1e-3 * self.calls))


class CountsCalls(ReferenceGPT):
    """A model whose layers are not pure functions of their inputs, so recomputing them changes gradients.

    The numerics check must catch this; a check that always reports "equal" could not.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.blocks = nn.ModuleList(_CountingBlockWrapper(b) for b in self.blocks)
