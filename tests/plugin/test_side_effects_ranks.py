"""Module state under recomputation on two CPU gloo ranks: DDP and FSDP2 (ModelParallelStrategy).

One two-process launch per strategy (Lightning starts the second rank by re-running the script),
with a deadline; each fits a BatchNorm net without recomputation and with a mixed policy, from the
same seed, and rank 0 saves the whole state (every ``state_dict`` entry, unsharded, and the
eval-mode output) of each. DDP keeps BatchNorm, whose buffers it broadcasts from rank 0 before every
forward: SyncBatchNorm runs on CUDA only (torch refuses it on CPU).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import child_env
from tests.plugin.stateful_models import differing

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="PyTorch built without distributed"),
]

SCRIPT = """
import sys, torch, lightning as L
from torch.distributed.fsdp import fully_shard
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_recompute import QUIET_TRAINER, RecomputeCallback, RecomputePolicy
from tests.plugin.stateful_models import StatefulNet, images

MIXED = RecomputePolicy.from_modes({"blocks.0": "full", "blocks.1": "selective", "blocks.2": "none"})


class Sharded(StatefulNet):
    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


def fit(strategy, how, out):
    L.seed_everything(0, verbose=False)
    if strategy == "ddp":
        model, kw = StatefulNet("batchnorm"), {"strategy": "ddp"}
    else:
        model = Sharded("batchnorm")
        kw = {"strategy": ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)}
    callbacks = [RecomputeCallback(MIXED)] if how == "mixed" else []
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=3, callbacks=callbacks, limit_val_batches=0,
                        num_sanity_val_steps=0, default_root_dir=out, **QUIET_TRAINER, **kw)
    trainer.fit(model, images(n=48, batch_size=4))
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in model.state_dict().items()}
    model.eval()
    with torch.no_grad():
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
        state["eval output"] = model(x)
    if trainer.global_rank == 0:
        torch.save(state, f"{out}/{strategy}-{how}.pt")
    torch.distributed.barrier()


if __name__ == "__main__":
    for how in ("none", "mixed"):
        fit(sys.argv[1], how, sys.argv[2])
    torch.distributed.destroy_process_group()
"""


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_batchnorm_statistics_on_two_ranks_equal_a_run_without_recompute(tmp_path: Path, strategy: str) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), strategy, str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    plain, mixed = (torch.load(tmp_path / f"{strategy}-{how}.pt") for how in ("none", "mixed"))
    assert not differing(plain, mixed)
    key = "blocks.0.bn1.num_batches_tracked"
    assert int(mixed[key]) == 3
