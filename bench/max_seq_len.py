"""The longest sequence that fits, per policy family, predicted and then measured (CPU).

Runs `tuner._commands.max_seq_len` (``recompute-tune plan RECIPE --max-seq-len``) on a small GPT
(the quickstart's reference model: 6 blocks of width 64, eager attention, micro-batch 8) under a
budget, then trains two real steps on CPU at each family's predicted length and one step past it,
and prints the measured peaks (the callback's exact storage ledger, as the tuner's trials measure).
The search profiles on the meta device by default (memory there is what the ledger counts; step
times are then estimates for the named accelerator); ``--measured`` profiles on this CPU instead.

    python bench/max_seq_len.py [--budget 45.6MiB] [--step 16] [--measured]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

from lightning_recompute import step_peak
from lightning_recompute.planner import Planner
from lightning_recompute.planner.seqlen import BEST_MIXED
from lightning_recompute.units import format_bytes, format_seconds, parse_bytes
from tuner import _commands as commands
from tuner._trials import profile_recipe
from tuner.recipe import Recipe, build_datamodule, build_model, from_dict
from tuner.recipe._profile import profile_recipe_meta

RESULTS = Path(__file__).parent / "results" / "max_seq_len.txt"


def recipe(budget: int) -> Recipe:
    return from_dict(
        {
            "name": "max-seq-len-bench",
            "model": {
                "class_path": "lightning_recompute.reference.ReferenceGPT",
                "init_args": {
                    "vocab_size": 256,
                    "seq_len": 128,
                    "n_layer": 6,
                    "n_embd": 64,
                    "n_head": 4,
                    "dropout": 0.1,
                    "attention": "eager",
                },
            },
            "data": {"init_args": {"batch_size": 8, "num_batches": 2}},
            "budget": {"value": budget, "margin": 0.0},
            "search": {"modes": ["none", "selective", "full"], "n_trials": 2},
            "trial": {"env": {"OMP_NUM_THREADS": 1}},
        }
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="45.6MiB")
    parser.add_argument("--step", type=int, default=16)
    parser.add_argument("--measured", action="store_true", help="profile on this CPU instead of the meta device")
    args = parser.parse_args()
    budget = parse_bytes(args.budget)
    r = recipe(budget)
    meta = None if args.measured else "H100"
    began = time.perf_counter()
    s = commands.max_seq_len(r, meta=meta, step=args.step, cap=4096)
    search_s = time.perf_counter() - began
    lines = [
        f"longest sequence per family, small GPT (6 x 64, eager, micro-batch 8), budget {format_bytes(budget)}",
        f"torch {torch.__version__}, {platform.machine()}; search on {s.device}, step {s.step}, "
        f"{s.profiles} lengths profiled in {search_s:.0f} s; measured: 2 CPU training steps, peak of the second",
        f"{'family':<12}{'seq_len':>8}{'pred peak':>12}{'meas peak':>12}{'fits':>6}"
        f"{'+step meas':>12}{'fits':>6}{'pred step':>11}  policy",
    ]
    for f in s.fits:
        if f.plan is None or f.seq_len is None:
            lines.append(f"{f.family:<12}{'-':>8}  nothing fits")
            continue
        at, _ = commands.with_seq_len(r, "seq_len", f.seq_len)
        here = step_peak(build_model(at), build_datamodule(at), f.plan.policy, layers=at.layers)
        longer, _ = commands.with_seq_len(r, "seq_len", f.seq_len + s.step)
        if f.family == BEST_MIXED:  # past it nothing fits: measure the policy of least predicted peak there
            prof = profile_recipe_meta(longer, None, "H100") if meta else profile_recipe(longer, None)
            least = Planner(prof).pareto_front(list(r.search.modes))[0].policy
        else:
            least = f.plan.policy
        past = step_peak(build_model(longer), build_datamodule(longer), least, layers=longer.layers)
        lines.append(
            f"{f.family:<12}{f.seq_len:>8}{format_bytes(f.plan.peak_bytes):>12}{format_bytes(here):>12}"
            f"{'yes' if here <= budget else 'NO':>6}{format_bytes(past):>12}{'yes' if past <= budget else 'no':>6}"
            f"{format_seconds(f.plan.step_time_s):>11}  {f.plan.short()}"
        )
    text = "\n".join(lines)
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
