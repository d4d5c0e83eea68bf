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
from torch.utils.data import DataLoader, TensorDataset

from lightning_recompute.reference import ReferenceGPT, SyntheticTokens


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


class OOMUnlessRecomputed(ReferenceGPT):
    """Runs out of memory, as a GPU would, when the activations it keeps exceed ``capacity``.

    Memory is counted in block-samples: each block that is not recomputed (mode ``none`` or
    ``offload``) keeps one per sample of the micro-batch. With 6 blocks and ``capacity`` 8, a
    micro-batch of 4 needs at least 4 recomputed blocks, while no recompute fits at a micro-batch
    of 1 only: the model for which a no-recompute baseline at the recipe's micro-batch cannot run.
    """

    def __init__(self, capacity: int = 8, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.capacity = capacity

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        from lightning_recompute.apply import applied_policy
        from lightning_recompute.policy import Mode

        applied = applied_policy(self)
        modes = list(applied.modes.values()) if applied is not None else []
        recomputed = sum(1 for m in modes if m in (Mode.FULL, Mode.SELECTIVE))
        kept = (len(self.blocks) - recomputed) * int(batch[0].shape[0])
        if kept > self.capacity:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory: {kept} block-samples of activations kept, room for {self.capacity} "
                "(injected by tests.tuner.faulty.OOMUnlessRecomputed)"
            )
        return super().training_step(batch, batch_idx)


class _ReseedingDropout(nn.Module):
    """Dropout on its block's input with a mask drawn from a generator reseeded on every call.

    A recomputation is a second call, so it draws a different mask than the forward did: the
    broken RNG replay the numerics check must catch (checkpoint's ``preserve_rng_state`` restores
    the global RNG, not this private generator).
    """

    def __init__(self, block: nn.Module, p: float = 0.5) -> None:
        super().__init__()
        self.block = block
        self.p = p
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            gen = torch.Generator(device=x.device).manual_seed(1000 + self.calls)
            keep = torch.rand(x.shape, generator=gen, device=x.device) >= self.p
            x = x * keep / (1.0 - self.p)
        return self.block(x)


class BrokenReplay(OOMUnlessRecomputed):
    """`OOMUnlessRecomputed` whose blocks replay a different dropout mask when recomputed."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.blocks = nn.ModuleList(_ReseedingDropout(b) for b in self.blocks)


class NanLoss(ReferenceGPT):
    """A model whose loss is nan from the first step (a diverged run, a bad batch), recompute or not."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * float("nan")


class Leaks(ReferenceGPT):
    """Keeps ``leak_bytes`` more each training step (a leak, a growing cache): its peak grows with every step."""

    def __init__(self, leak_bytes: int = 512 * 1024, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.leak_bytes = leak_bytes
        self.kept: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.kept.append(torch.ones(self.leak_bytes, dtype=torch.uint8))
        return super().training_step(batch, batch_idx)


class VaryingBatches(SyntheticTokens):
    """Batches whose sample counts take ``sizes`` in turn (dynamic batching, variable lengths): the first is the
    smallest, and the largest comes later in the epoch. ``batch_size`` is the nominal size a recipe names."""

    def __init__(self, sizes: tuple[int, ...] = (1, 8, 2, 16), batch_size: int = 4, **kwargs: Any) -> None:
        super().__init__(batch_size=batch_size, **kwargs)
        self.sizes = tuple(int(s) for s in sizes)

    def train_dataloader(self) -> DataLoader:
        counts = [self.sizes[i % len(self.sizes)] for i in range(max(self.num_batches, len(self.sizes)))]
        starts = [sum(counts[:i]) for i in range(len(counts))]
        batches = [list(range(s, s + c)) for s, c in zip(starts, counts, strict=True)]
        g = torch.Generator().manual_seed(self.seed)
        rows = torch.randint(0, self.vocab_size, (sum(counts), self.seq_len + 1), generator=g)
        return DataLoader(TensorDataset(rows[:, :-1], rows[:, 1:]), batch_sampler=batches)
