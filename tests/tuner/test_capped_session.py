"""A tuning session on a device where keeping every activation does not fit: the capped CPU.

``RECOMPUTE_CPU_MEMORY_LIMIT`` in the recipe's ``trial.env`` caps the profile, every trial (every rank
of it) and the numerics check between the predicted peaks of ``full`` and ``none``. The session must
plan from a profile that split ``none``, seed the planner's picks, and promote a policy under the
limit. Two DDP ranks, capped the same way: tests/tuner/trials/test_multirank.py's ddp session.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_recompute.meter import CPU_MEMORY_LIMIT
from lightning_recompute.policy import RecomputePolicy
from tests.capped import planned_cap
from tests.helpers import RACE_PLAN_ENV, SHORT_RACE
from tuner import session
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
        # Two ranks: two modes and three trials (each trial starts two processes); the planner's pick among them.
        "search": {
            "modes": ["none", "selective", "full"][:: 1 if devices == 1 else 2],
            "n_trials": 4 - devices // 2,
            "seed": 0,
        },
        "trial": {"warmup_steps": 1, "measure_steps": 1, "timeout_s": 240, "env": env},
        "tracking": {"uri": f"sqlite:///{tmp / 'mlflow.db'}"},
        "study": {"storage": f"sqlite:///{tmp / 'optuna.db'}"},
        "output": str(tmp / "policy.yaml"),
    }


def test_a_session_where_none_does_not_fit_plans_from_what_fits_and_promotes_under_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The race at its floor: its statistics are tested elsewhere; here it only has to pick a fitting policy.
    short = {**SHORT_RACE, "min_rounds": 2, "max_rounds": 3, "estimate_rounds": 2, "time_s": 5.0}
    monkeypatch.setenv(RACE_PLAN_ENV, json.dumps(short))
    devices = 1  # two DDP ranks: tests/tuner/trials/test_multirank.py's ddp session runs capped the same way
    cap = planned_cap(from_dict(_recipe(tmp_path, devices, None)))
    recipe = from_dict(_recipe(tmp_path, devices, cap))
    notes: list[str] = []
    summary = session.tune(recipe, handle_signals=False, on_note=notes.append)
    assert summary.status == "promoted", (summary.reasons, notes)
    planned = next(n for n in notes if n.startswith("planner: planned from a profile"))
    assert "none did not fit with every layer in it" in planned, planned
    if devices > 1:
        assert "for one rank of 2 (ddp)" in planned, planned
    assert any(r.source.value == "planner" and r.outcome == "ok" for r in summary.records), summary.records
    best = summary.best
    assert best is not None and best.peak_bytes is not None and best.peak_bytes <= cap
    assert best.policy is not None and best.policy != RecomputePolicy.uniform("none")
    assert RecomputePolicy.load(recipe.output) == best.policy
