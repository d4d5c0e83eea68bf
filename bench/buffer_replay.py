"""What restoring a recomputed layer's buffers costs: step time side by side, and bytes held per layer.

A BatchNorm conv net (ResNet basic blocks) trained with ``full`` on every block, interleaved in one
process, rotated each round:
  restore     the plugin as shipped: the replay runs on a copy of each layer's buffers
  no-restore  the same without the copy (what the plugin did before: BatchNorm statistics updated twice)
  none        no recomputation, for scale
The figure is the paired ratio restore / no-restore over rounds (median of per-round ratios of
median step times, with its distribution-free 95% interval), and the bytes the copy holds per layer.

Run:  python bench/buffer_replay.py [--rounds 12] [--channels 64] [--size 32]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test models (tests.plugin.stateful_models)

import lightning_recompute.apply as apply
from lightning_recompute import RecomputePolicy, apply_policy, remove_policy
from lightning_recompute.race.stats import paired_ratio
from lightning_recompute.replay import BufferState
from tests.plugin.stateful_models import StatefulNet

CONFIGS = ("restore", "no-restore", "none")


def _steps(model: StatefulNet, config: str, batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> list[float]:
    remove_policy(model)
    if config != "none":
        apply_policy(model, RecomputePolicy.uniform("full"))
    real = apply.Replay
    if config == "no-restore":
        apply.Replay = lambda forward, *a, **k: forward.inner  # type: ignore[assignment,misc]
    try:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            model.training_step(batch, 0).backward()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        return times
    finally:
        apply.Replay = real  # type: ignore[misc]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = StatefulNet("batchnorm", channels=args.channels)
    batch = (torch.randn(args.batch, 3, args.size, args.size), torch.randint(0, 5, (args.batch,)))
    _steps(model, "restore", batch, 2)  # warm up
    per_round: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for r in range(args.rounds):
        order = CONFIGS[r % len(CONFIGS) :] + CONFIGS[: r % len(CONFIGS)]
        for config in order:
            per_round[config].append(statistics.median(_steps(model, config, batch, args.steps)))
    ratio = paired_ratio(per_round["no-restore"], per_round["restore"])
    vs_none = paired_ratio(per_round["none"], per_round["restore"])
    held = BufferState(model.blocks[0]).nbytes
    out: dict[str, Any] = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__,
        "model": f"3 BatchNorm basic blocks, {args.channels} channels, {args.size}x{args.size}, batch {args.batch}",
        "median step s": {c: round(statistics.median(v), 5) for c, v in per_round.items()},
    }
    for k, v in out.items():
        print(f"{k}: {v}")
    print(
        f"restore / no-restore: {ratio.ratio:.4f} ({ratio.low:.4f}..{ratio.high:.4f}, "
        f"{ratio.confidence:.0%} interval, {ratio.rounds} rounds)"
    )
    print(f"restore / none: {vs_none.ratio:.4f} ({vs_none.low:.4f}..{vs_none.high:.4f})")
    print(f"bytes held per layer (two BatchNorm2d({args.channels})): {held}")


if __name__ == "__main__":
    main()
