"""RecomputeCallback under ModelParallelStrategy (FSDP2's fully_shard) on two CPU gloo ranks.

One two-process run (Lightning launches the second rank by re-running the script), with a
deadline, fits the three configurations in turn, each from the same seed with a fresh model and
Trainer (the process group, once made, serves every fit: a launch per configuration would import
torch and Lightning six times instead of twice); rank 0 saves the full (unsharded) weights after
three AdamW steps with dropout, and every rank prints its measured peak.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="PyTorch built without distributed")

SCRIPT = """
import gc, sys, torch, lightning as L
from torch import nn
from torch.distributed.fsdp import fully_shard
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_recompute import QUIET_TRAINER, RecomputeCallback, RecomputePolicy, applied_policy, apply_policy
from lightning_recompute.reference import Block, ReferenceGPT, SyntheticTokens

MIXED = RecomputePolicy.from_modes(
    {"blocks.0": "full", "blocks.1": "selective", "blocks.2": "full", "blocks.3": "none"}
)


class Sharded(ReferenceGPT):
    \"\"\"Builds its blocks in configure_model and shards them with fully_shard, as FSDP2 users do.\"\"\"

    def __init__(self, apply_here=None):
        super().__init__(vocab_size=64, seq_len=32, n_layer=1, n_embd=32, n_head=4, dropout=0.1, learning_rate=1e-2)
        del self.blocks
        self.apply_here = apply_here

    def configure_model(self):
        if hasattr(self, "blocks"):
            return
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(32, 4, 0.1, "eager", 4, 32) for _ in range(4))
        if self.apply_here is not None:
            apply_policy(self, self.apply_here)
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


def fit(how, out):
    torch.manual_seed(0)
    FULL = RecomputePolicy.uniform("full")
    callback_policy = {"none": RecomputePolicy.uniform("none"), "callback": MIXED, "before": FULL}[how]
    model = Sharded(apply_here=FULL if how == "before" else None)
    cb = RecomputeCallback(callback_policy)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2,
                        tensor_parallel_size=1), max_steps=3, callbacks=[cb], **QUIET_TRAINER,
                        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=out)
    trainer.fit(model, SyntheticTokens(vocab_size=64, seq_len=32, batch_size=4, num_batches=8))
    modes = {k: v.value for k, v in applied_policy(model).modes.items()}
    full = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    if trainer.global_rank == 0:
        torch.save(full, f"{out}/weights-{how}.pt")
    peak = cb.records[-1].peak_bytes
    # One write per line: with PYTHONUNBUFFERED, print() writes the text and its newline apart, and
    # the other rank's line can land in between.
    sys.stdout.write(f"RANK{trainer.global_rank} {how} modes={modes} records={len(cb.records)} peak={peak}\\n")
    sys.stdout.flush()
    torch.distributed.barrier()


if __name__ == "__main__":
    for how in ("none", "callback", "before"):
        fit(how, sys.argv[1])
        gc.collect()  # the last configuration's model and optimizer state off the ledger before the next
    torch.distributed.destroy_process_group()
"""


def _run(tmp_path: Path) -> tuple[str, dict[str, dict[str, torch.Tensor]]]:
    script = tmp_path / "fsdp2_run.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout, {how: torch.load(tmp_path / f"weights-{how}.pt") for how in ("none", "callback", "before")}


def _peaks(stdout: str, how: str) -> list[int]:
    return [int(p) for p in re.findall(rf"RANK\d {how} .*? peak=(\d+)", stdout)]


@pytest.mark.slow
def test_model_parallel_fsdp2_bitwise_after_or_before_sharding_and_lower_peak(tmp_path: Path) -> None:
    out, weights = _run(tmp_path)
    reference = weights["none"]
    expected = "modes={'blocks.0': 'full', 'blocks.1': 'selective', 'blocks.2': 'full', 'blocks.3': 'none'} records=3"
    assert f"RANK0 callback {expected}" in out and f"RANK1 callback {expected}" in out, out
    assert weights["callback"].keys() == reference.keys()
    for key in reference:
        assert torch.equal(weights["callback"][key], reference[key]), key
    # Every block applied full in configure_model, before fully_shard: the same weights, and each
    # rank's peak (the CPU storage ledger) lower than without recomputation.
    assert "RANK0 before modes={'blocks.0': 'full', 'blocks.1': 'full', 'blocks.2': 'full', 'blocks.3': 'full'}" in out
    for key in reference:
        assert torch.equal(weights["before"][key], reference[key]), key
    none_peaks, full_peaks = _peaks(out, "none"), _peaks(out, "before")
    assert len(none_peaks) == len(full_peaks) == 2, out
    for none, full in zip(none_peaks, full_peaks, strict=True):
        assert none > full > 0
