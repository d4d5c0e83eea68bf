"""A tuning session on a device where keeping every activation does not fit: the capped CPU.

``RECOMPUTE_CPU_MEMORY_LIMIT`` in the recipe's ``trial.env`` caps the profile, every trial (every rank
of it) and the numerics check between the predicted peaks of ``full`` and ``none``. The session must
plan from a profile that split ``none``, seed the planner's picks, and promote a policy under the
limit; on one device and on two DDP ranks (one rank's figures, from the sharded plan).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_recompute.meter import CPU_MEMORY_LIMIT
from lightning_recompute.policy import RecomputePolicy
from tests.helpers import SHORT_RACE
from tuner import session
from tuner.planner import Planner
from tuner.planner.sharding import recipe_layout, shard_profile, sharding_for
from tuner.profile.recipe_profile import profile_recipe_here
from tuner.recipe import from_dict

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="PyTorch built without distributed"),
]


def _recipe(tmp: Path, devices: int, cap: int | None) -> dict[str, Any]:
    env = {"OMP_NUM_THREADS": "1"} | ({} if cap is None else {CPU_MEMORY_LIMIT: str(cap)})
    return {
        "name": f"capped-{devices}",
        "model": {
            "init_args": {"vocab_size": 64, "seq_len": 64, "n_layer": 4, "n_embd": 32, "n_head": 4, "dropout": 0.1}
        },
        "data": {"init_args": {"batch_size": 4, "num_batches": 8}},
        "trainer": {"accelerator": "cpu", "devices": devices, **({"strategy": "ddp"} if devices > 1 else {})},
        "budget": {"value": cap or "1GiB", "margin": 0.0},
        "search": {"modes": ["none", "selective", "full"], "n_trials": 4, "seed": 0},
        "trial": {"warmup_steps": 1, "measure_steps": 2, "timeout_s": 240, "env": env},
        "race": SHORT_RACE,
        "tracking": {"uri": f"sqlite:///{tmp / 'mlflow.db'}"},
        "study": {"storage": f"sqlite:///{tmp / 'optuna.db'}"},
        "output": str(tmp / "policy.yaml"),
    }


def _cap(tmp: Path, devices: int) -> int:
    """Midway between the planner's predicted peaks of full and none for one rank, from an uncapped profile."""
    recipe = from_dict(_recipe(tmp, devices, None))
    profile = profile_recipe_here(recipe, None, 1)
    sharding = sharding_for(recipe)
    if sharding is not None:
        profile = shard_profile(profile, recipe_layout(recipe, profile.layer_names), sharding)
    planner = Planner(profile)
    none, full = (planner.predict(RecomputePolicy.uniform(m)).peak_bytes for m in ("none", "full"))
    return (none + full) // 2


@pytest.mark.parametrize("devices", [1, 2])
def test_a_session_where_none_does_not_fit_plans_from_what_fits_and_promotes_under_the_limit(
    tmp_path: Path, devices: int
) -> None:
    cap = _cap(tmp_path, devices)
    recipe = from_dict(_recipe(tmp_path, devices, cap))
    notes: list[str] = []
    summary = session.tune(recipe, handle_signals=False, on_note=notes.append)
    assert summary.status == "promoted", (summary.reasons, notes)
    planned = next(n for n in notes if n.startswith("planner: planned from a profile"))
    assert "none did not fit with every layer in it" in planned, planned
    if devices > 1:
        assert "for one rank of 2 (ddp)" in planned, planned
    assert any((r.seed or "").startswith("planner:") and r.outcome == "ok" for r in summary.records), summary.records
    best = summary.best
    assert best is not None and best.peak_bytes is not None and best.peak_bytes <= cap
    assert best.policy is not None and best.policy != RecomputePolicy.uniform("none")
    assert RecomputePolicy.load(recipe.output) == best.policy
