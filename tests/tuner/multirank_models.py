"""LightningModules for the multi-rank trial tests: one rank fails while the others wait for it.

Each subclasses the reference GPT; the failure is injected in rank ``fail_rank`` only, so the other
ranks block in DDP's gradient all-reduce, as they would when one GPU of a node runs out of memory.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from lightning_recompute.reference import ReferenceGPT


class OneRankFails(ReferenceGPT):
    """Rank ``fail_rank`` raises an out-of-memory error (``how="oom"``) or hangs (``how="hang"``).

    Every rank first writes ``rank<N>.pid`` (its pid) into ``marks``, so a test knows all ranks ran
    and which processes to look for afterwards.
    """

    def __init__(self, marks: str = "", how: str = "oom", fail_rank: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.marks, self.how, self.fail_rank = marks, how, fail_rank

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        rank = self.global_rank
        if self.marks:
            Path(self.marks, f"rank{rank}.pid").write_text(str(os.getpid()), encoding="utf-8")
        if rank == self.fail_rank:
            if self.how == "oom":
                raise torch.OutOfMemoryError(f"CUDA out of memory on rank {rank} (injected by tests.tuner)")
            while True:  # the other ranks wait for this one in the all-reduce, forever
                time.sleep(1.0)
        return super().training_step(batch, batch_idx)
