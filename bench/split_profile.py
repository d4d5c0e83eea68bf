"""The planner's peak predictions from a profile that could not hold the whole model, against measured peaks.

For each model: profile it on the uncapped CPU (every mode fits), then on the CPU capped between the
predicted peaks of ``full`` and ``none`` (``RECOMPUTE_CPU_MEMORY_LIMIT``), where ``none`` runs out of
memory with every layer in it and is profiled a group of layers at a time. For the uniform policies
and N random mixed ones, the peak each profile's planner predicts is compared with the peak measured
on a real step (the exact CPU storage ledger, uncapped, so that every policy can be measured).
Target: every error within 3%. Run:

    python bench/split_profile.py [--policies 12]

The table is printed and written to bench/results/split_profile.txt.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test models (tests.plugin.stateful_models)

from planner_accuracy import build, loss_fn, measure_peak, random_policies

from lightning_recompute import RecomputePolicy
from lightning_recompute.meter import CPU_MEMORY_LIMIT
from lightning_recompute.planner import Planner
from lightning_recompute.profile import Profile, profile_model
from lightning_recompute.units import format_bytes
from tests.plugin.stateful_models import StatefulNet

MODES = ("none", "selective", "full")


def _conv() -> tuple[StatefulNet, Any]:
    torch.manual_seed(0)
    model = StatefulNet("batchnorm", channels=32)
    g = torch.Generator().manual_seed(0)
    return model, (torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 5, (16,), generator=g))


def _gpt(size: str, attention: str) -> tuple[Any, Any]:
    return build(size, attention)


MODELS = {
    "gpt small eager": lambda: _gpt("small", "eager"),
    "gpt large sdpa": lambda: _gpt("large", "sdpa"),
    "batchnorm conv": _conv,
}


def _profile(model: Any, batch: Any) -> Profile:
    return profile_model(
        model,
        batch,
        modes=MODES,
        loss_fn=loss_fn,
        repeats=1,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
        free_grads_at_batch_start=False,  # Lightning's order, as the measured steps below
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "split_profile.txt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = [f"machine: {platform.machine()}, torch {torch.__version__}; peaks on the exact CPU storage ledger", ""]
    worst = 0.0
    for name, make in MODELS.items():
        model, batch = make()
        os.environ.pop(CPU_MEMORY_LIMIT, None)
        whole = _profile(model, batch)
        planner = Planner(whole)
        none = planner.predict(RecomputePolicy.uniform("none")).peak_bytes
        full = planner.predict(RecomputePolicy.uniform("full")).peak_bytes
        cap = (none + full) // 2
        os.environ[CPU_MEMORY_LIMIT] = str(cap)
        try:
            split = _profile(model, batch)
        finally:
            os.environ.pop(CPU_MEMORY_LIMIT, None)
        capped = Planner(split)
        names = whole.layer_names
        policies = [RecomputePolicy.uniform(m) for m in MODES] + random_policies(names, args.policies, seed=0)
        lines.append(
            f"{name}: capped at {format_bytes(cap)} (none {format_bytes(none)}, full {format_bytes(full)}); "
            f"the capped profile split {split.split}"
        )
        lines.append(f"  {'policy':<10} {'measured':>12} {'whole profile':>14} {'capped profile':>15}")
        for policy in policies:
            measured = measure_peak(model, batch, torch.optim.AdamW(model.parameters(), lr=1e-4), policy)
            errors = []
            for p in (planner, capped):
                predicted = p.predict(policy).peak_bytes
                errors.append((predicted - measured) / measured)
            worst = max(worst, abs(errors[1]))
            lines.append(
                f"  {policy.short(names):<10} {format_bytes(measured):>12} {errors[0]:>+13.2%} {errors[1]:>+14.2%}"
            )
        lines.append("")
    lines.append(f"worst error of a prediction from a capped profile: {worst:.2%} (target: within 3%)")
    text = "\n".join(lines)
    print(text)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
