"""`AutoRecompute` on two data-parallel CPU ranks (DDP, gloo): every rank races the same turns, drops the
same candidates and settles on rank 0's decision, and training is a plain DDP run's, bitwise.

One launch (Lightning starts the second rank by re-running the script) fits the plain run and the
tuned run in turn from the same seed; the process group serves both.
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
from lightning_recompute import QUIET_TRAINER
from lightning_recompute.reference import ReferenceGPT, SyntheticTokens
from tuner.auto import AutoRecompute
from tuner.race import RacePlan


def fit(tuned, out):
    L.seed_everything(0, verbose=False)
    model = ReferenceGPT(vocab_size=64, seq_len=32, n_layer=3, n_embd=32, n_head=4, dropout=0.1)
    plan = RacePlan(steps=1, min_rounds=2, max_rounds=3, time_s=1e9, estimate_rounds=2, warmup_steps=1)
    callbacks = [AutoRecompute("1GiB", plan=plan, profile_repeats=1)] if tuned else []
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=40, callbacks=callbacks,
                        **QUIET_TRAINER, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=out)
    trainer.fit(model, SyntheticTokens(vocab_size=64, seq_len=32, batch_size=4, num_batches=64))
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), f"{out}/weights-{'auto' if tuned else 'plain'}.pt")
    if tuned:
        auto = callbacks[0]
        turns = ",".join(r.policy for r in auto.records)
        # One write per line: the other rank's output must not land inside it.
        sys.stdout.write(f"RANK{trainer.global_rank} decision={auto.decision.policy.fingerprint()} "
                         f"candidates={len(auto.candidates)} turns={turns}\\n")
        sys.stdout.flush()
    torch.distributed.barrier()


if __name__ == "__main__":
    fit(False, sys.argv[1])
    fit(True, sys.argv[1])
    torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_two_ranks_race_the_same_turns_agree_on_rank_zeros_decision_and_train_bitwise(tmp_path: Path) -> None:
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
    lines = dict(re.findall(r"RANK(\d) (.*)", proc.stdout))
    assert set(lines) == {"0", "1"}, proc.stdout[-2000:]
    assert lines["0"] == lines["1"], "the ranks raced different turns or decided differently"
    assert int(re.search(r"candidates=(\d+)", lines["0"]).group(1)) >= 2  # type: ignore[union-attr]
    turns = re.search(r"turns=(\S+)", lines["0"]).group(1).split(",")  # type: ignore[union-attr]
    assert len(set(turns)) >= 2 and len(turns) == 40
    plain, auto = torch.load(tmp_path / "weights-plain.pt"), torch.load(tmp_path / "weights-auto.pt")
    assert plain.keys() == auto.keys()
    assert [k for k in plain if not torch.equal(plain[k], auto[k])] == []
