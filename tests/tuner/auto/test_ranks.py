"""`AutoRecompute` on two CPU ranks (gloo), under DDP and under FSDP2 (ModelParallelStrategy's
``fully_shard``): every rank races the same turns, drops the same candidates and settles on rank 0's
decision, and training is the plain run's of the same strategy, bitwise.

One launch (Lightning starts the second rank by re-running the script) fits, per strategy, the plain
run and the tuned run in turn from the same seed; the process group serves all four.
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
import sys, torch, lightning as L
from torch import nn
from torch.distributed.fsdp import fully_shard
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_recompute import QUIET_TRAINER
from lightning_recompute.reference import Block, ReferenceGPT, SyntheticTokens
from lightning_recompute.auto import AutoRecompute
from lightning_recompute.race import RacePlan

TINY = dict(vocab_size=64, seq_len=32, n_embd=32, n_head=4, dropout=0.1)


class Sharded(ReferenceGPT):
    \"\"\"Builds its blocks in configure_model and shards them with fully_shard, as FSDP2 users do.\"\"\"

    def __init__(self):
        super().__init__(n_layer=1, **TINY)
        del self.blocks

    def configure_model(self):
        if hasattr(self, "blocks"):
            return
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(32, 4, 0.1, "eager", 4, 32) for _ in range(3))
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


def fit(strategy, tuned, out):
    L.seed_everything(0, verbose=False)
    if strategy == "ddp":
        model, how = ReferenceGPT(n_layer=3, **TINY), "ddp"
    else:
        model, how = Sharded(), ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    plan = RacePlan(steps=1, min_rounds=2, max_rounds=3, time_s=1e9, estimate_rounds=2, warmup_steps=1)
    callbacks = [AutoRecompute("1GiB", plan=plan, profile_repeats=1)] if tuned else []
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=how, max_steps=40, callbacks=callbacks,
                        **QUIET_TRAINER, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=out)
    trainer.fit(model, SyntheticTokens(vocab_size=64, seq_len=32, batch_size=4, num_batches=64))
    weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
               for k, v in model.state_dict().items()}
    if trainer.global_rank == 0:
        torch.save(weights, f"{out}/weights-{strategy}-{'auto' if tuned else 'plain'}.pt")
    if tuned:
        auto = callbacks[0]
        turns = ",".join(r.policy for r in auto.records)
        # One write per line: the other rank's output must not land inside it.
        sys.stdout.write(f"RANK{trainer.global_rank} {strategy} decision={auto.decision.policy.fingerprint()} "
                         f"candidates={len(auto.candidates)} turns={turns}\\n")
        sys.stdout.flush()
    torch.distributed.barrier()


if __name__ == "__main__":
    for strategy in ("ddp", "fsdp2"):
        fit(strategy, False, sys.argv[1])
        fit(strategy, True, sys.argv[1])
    torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_two_ranks_race_the_same_turns_agree_on_rank_zeros_decision_and_train_bitwise(tmp_path: Path) -> None:
    """DDP profiles on rank 0 and races the planner's candidates; FSDP2 (sharded: not profiled in the
    job) races the uniform policies. Either way the ranks agree turn by turn."""
    script = tmp_path / "auto_ddp.py"
    script.write_text(SCRIPT)
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": str(root)},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = {(rank, strategy): rest for rank, strategy, rest in re.findall(r"RANK(\d) (\w+) (.*)", proc.stdout)}
    assert set(lines) == {(r, s) for r in "01" for s in ("ddp", "fsdp2")}, proc.stdout[-2000:]
    for strategy in ("ddp", "fsdp2"):
        line = lines[("0", strategy)]
        assert line == lines[("1", strategy)], f"{strategy}: the ranks raced different turns or decided differently"
        assert int(re.search(r"candidates=(\d+)", line).group(1)) >= 2  # type: ignore[union-attr]
        turns = re.search(r"turns=(\S+)", line).group(1).split(",")  # type: ignore[union-attr]
        assert len(set(turns)) >= 2 and len(turns) == 40
        plain = torch.load(tmp_path / f"weights-{strategy}-plain.pt")
        auto = torch.load(tmp_path / f"weights-{strategy}-auto.pt")
        assert plain.keys() == auto.keys()
        assert [k for k in plain if not torch.equal(plain[k], auto[k])] == [], strategy
