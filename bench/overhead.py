"""Overhead of the plugin itself, side by side in one interleaved run.

Compares the median step time of:
  plain        Lightning without the plugin
  cb-none      RecomputeCallback, policy none on every layer, memory meter off   (target: <= 1% over plain)
  cb-none+mem  the same with the CPU storage meter on (free on CUDA; a Python call per op on CPU)
  hand-full    every block wrapped by hand in torch.utils.checkpoint (non-reentrant)
  cb-full      RecomputeCallback, full on every layer, memory meter off         (target: within 2% of hand-full)

Every configuration runs once per round, in a rotated order, for several rounds; the figure
for each is the median over all its measured steps. On a shared, noisy CPU a 1% difference on a
~1 s step is below the noise floor, so the callback's own cost is also measured directly: the
same pair (plain, cb-none) on a tiny model whose step is ~ms, where the difference of medians
is the callback's absolute cost per step, then expressed as a fraction of the reference step.

Run:  python bench/overhead.py [--rounds 6]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.checkpoint import checkpoint

from lightning_recompute import QUIET_TRAINER, RecomputeCallback, RecomputePolicy
from lightning_recompute.reference import ReferenceGPT, SyntheticTokens

MODEL = dict(vocab_size=512, seq_len=256, n_layer=6, n_embd=256, n_head=8, dropout=0.1, attention="eager")
DATA = dict(vocab_size=512, seq_len=256, batch_size=8, num_batches=64)
TINY_MODEL = dict(vocab_size=32, seq_len=8, n_layer=2, n_embd=16, n_head=2, dropout=0.1, attention="eager")
TINY_DATA = dict(vocab_size=32, seq_len=8, batch_size=2, num_batches=1000)


class HandCheckpointGPT(ReferenceGPT):
    """What a user writes by hand: checkpoint every block in forward."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if torch.is_grad_enabled() else block(x)
        return self.head(self.ln_f(x))


class StepClock(L.Callback):
    """The same timer for every configuration, so its own cost cancels out."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._t)


def run(config: str, steps: int, warmup: int, tiny: bool = False) -> list[float]:
    torch.manual_seed(0)
    model_cls = HandCheckpointGPT if config == "hand-full" else ReferenceGPT
    model = model_cls(**(TINY_MODEL if tiny else MODEL))
    clock = StepClock()
    callbacks: list[L.Callback] = [clock]
    if config.startswith("cb-"):
        mode = "full" if config == "cb-full" else "none"
        callbacks.append(RecomputeCallback(RecomputePolicy.uniform(mode), measure_memory=config.endswith("+mem")))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=warmup + steps,
        **QUIET_TRAINER,
        callbacks=callbacks,
    )
    trainer.fit(model, SyntheticTokens(**(TINY_DATA if tiny else DATA)))
    return clock.times[warmup:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny-steps", type=int, default=300)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a small shared machine, steadier than all cores)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs = ["plain", "cb-none", "cb-none+mem", "hand-full", "cb-full"]
    times: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for c in order:
            times[c] += run(c, args.steps, args.warmup)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    tiny: dict[str, list[float]] = {"plain": [], "cb-none": []}
    for r in range(args.rounds):
        for c in ["plain", "cb-none"] if r % 2 == 0 else ["cb-none", "plain"]:
            tiny[c] += run(c, args.tiny_steps, 20, tiny=True)
    med = {c: statistics.median(v) for c, v in times.items()}
    tiny_med = {c: statistics.median(v) for c, v in tiny.items()}
    hook_cost = tiny_med["cb-none"] - tiny_med["plain"]
    lines = [
        f"# bench/overhead.py  rounds={args.rounds} steps/round={args.steps} warmup={args.warmup}",
        f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, lightning {L.__version__}, python {platform.python_version()}",
        f"# model {MODEL}, batch {DATA['batch_size']}",
        f"{'config':<12} {'median step ms':>15} {'n':>4}  ratio",
    ]
    ref = {
        "plain": "plain",
        "cb-none": "plain",
        "cb-none+mem": "plain",
        "hand-full": "hand-full",
        "cb-full": "hand-full",
    }
    for c in configs:
        ratio = med[c] / med[ref[c]]
        lines.append(f"{c:<12} {med[c] * 1e3:>15.2f} {len(times[c]):>4}  {ratio:.4f} vs {ref[c]}")
    lines.append(
        f"callback cost per step (tiny model, {len(tiny['plain'])} steps each): "
        f"plain {tiny_med['plain'] * 1e6:.0f} us, cb-none {tiny_med['cb-none'] * 1e6:.0f} us -> "
        f"{hook_cost * 1e6:.0f} us/step = {hook_cost / med['plain'] * 100:.3f}% of the reference step"
    )
    text = "\n".join(lines)
    print(text)
    out = Path(__file__).parent / "results" / "overhead.txt"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
