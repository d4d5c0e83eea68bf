"""A tuning session on the device (``python -m tuner RECIPE``) that must promote a policy."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_recompute import RecomputePolicy
from lightning_recompute.planner import Planner
from tests.gpu.common import Device, recipe_dict
from tests.helpers import RACE_PLAN_ENV, REPO

SESSION_FIGURE_KEYS = ("best", "gains", "vs")
"""Top-level keys of the tuner's JSON summary whose speed and uncertainty figures are recorded: the
chosen trial and the race's "vs" figures with their intervals (``race`` itself, every entrant's
per-round times, stays in the session's own output)."""
_NOT_FIGURES = frozenset({"number", "policy", "seed", "duplicate_of", "micro_batch", "round"})
"""Numbers in the summary that are identifiers, not measurements."""


def _numbers(value: Any, prefix: str = "") -> dict[str, float]:
    """Every measured number in ``value``, flattened as ``a.b.c``: whatever speed and uncertainty figures it holds."""
    out: dict[str, float] = {}
    if isinstance(value, Mapping):
        for k, v in value.items():
            if k not in _NOT_FIGURES:
                out.update(_numbers(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out[prefix] = value
    return out


def _write_recipe(device: Device, folder: Path) -> dict[str, int]:
    """The session's recipe in ``folder``, with a budget limit between full's and none's predicted peaks
    (60% of the way up), so recomputation is needed; the limit and both predictions."""
    from tuner.recipe import from_dict
    from tuner.recipe._profile import profile_recipe_meta

    sz = device.sizes
    raw = recipe_dict(
        sz.session_model,
        sz.session_batch,
        device.type,
        "32-true",  # the meta-device prediction that sets the budget is of fp32 activations
        name="gpu-acceptance-session",
        search={"modes": ["none", "selective", "full"], "n_trials": sz.session_trials, "seed": 0},
        trial={"warmup_steps": 2, "measure_steps": 3, "timeout_s": 120},
        tracking={"uri": "sqlite:///mlflow.db"},
        study={"storage": "sqlite:///optuna.db"},
        output="policy.yaml",
    )
    planner = Planner(profile_recipe_meta(from_dict(raw, source=folder / "recipe.yaml"), None, "H100"))
    full = planner.predict(RecomputePolicy.uniform("full")).peak_bytes
    none = planner.predict(RecomputePolicy.uniform("none")).peak_bytes
    limit = int(full + 0.6 * (none - full))
    margin = 0.05
    raw["budget"] = {"value": f"{math.ceil(limit / (1 - margin))}B", "margin": margin}
    (folder / "recipe.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    return {"limit_bytes": limit, "predicted_full_bytes": full, "predicted_none_bytes": none}


@pytest.mark.slow  # a tuning session: the tuner and its trials are processes
def test_session_promotes_a_policy_that_recomputes(device: Device, figures: dict[str, Any], tmp_path: Path) -> None:
    """``python -m tuner RECIPE --format json`` on a small recipe (sqlite stores), its budget between full's
    and none's predicted peaks so recomputation is needed: it must promote, and the policy file must hold the
    promoted policy. The promoted policy, its figures and every speed figure the summary has are recorded."""
    figures["budget"] = _write_recipe(device, tmp_path)
    figures["trials"] = device.sizes.session_trials
    path = os.pathsep.join(p for p in (str(REPO), device.child_env.get("PYTHONPATH")) if p)
    # The session's race, shortened to the check's minutes (RECOMPUTE_TUNE_RACE_PLAN: `RacePlan` fields).
    env = {**device.child_env, "PYTHONPATH": path, RACE_PLAN_ENV: json.dumps(device.sizes.session_race)}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "tuner", "recipe.yaml", "--format", "json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=device.sizes.session_timeout_s,
        check=False,
    )
    figures.update(exit_code=proc.returncode, wall_s=time.perf_counter() - started)
    try:
        summary = json.loads(proc.stdout)
    except json.JSONDecodeError:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        pytest.fail(f"the session exited {proc.returncode} without a JSON summary:\n{tail}")
    best = summary.get("best") or {}
    written = None
    if summary.get("policy_path") and Path(summary["policy_path"]).exists():
        written = RecomputePolicy.load(summary["policy_path"]).fingerprint()
    candidate = (summary.get("evidence") or {}).get("candidate", {}).get("fingerprint")
    figures.update(
        status=summary.get("status"),
        device=summary.get("device"),
        budget_bytes=summary.get("budget_bytes"),
        promoted_policy=best.get("policy_short"),
        promoted_fingerprint=candidate,
        policy_file_fingerprint=written,
        peak_bytes=best.get("peak_bytes"),
        predicted_peak_bytes=best.get("predicted_peak_bytes"),
        throughput=best.get("throughput"),
        throughput_unit=best.get("throughput_unit"),
        reasons=summary.get("reasons"),
    )
    for key in SESSION_FIGURE_KEYS:
        figures[f"summary.{key}"] = _numbers(summary[key]) if key in summary else None
    figures["summary.evidence.regression"] = _numbers(((summary.get("evidence") or {}).get("regression")) or {})

    assert summary.get("status") == "promoted" and proc.returncode == 0, (
        f"{summary.get('status')}, exit {proc.returncode}; the gate: {summary.get('reasons')}"
    )
    assert written is not None and written == candidate, (
        f"the policy file holds {written}, not the promoted {candidate}"
    )
    if not device.cuda:
        assert set(best["policy_short"]) != {"."}  # the budget sits below none's predicted peak: it recomputes
        assert best["peak_bytes"] <= summary["budget_bytes"], figures
        assert figures["summary.best"]["throughput"] > 0
