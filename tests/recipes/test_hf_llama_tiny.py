"""``recipes/hf-llama-tiny.yaml`` end to end: a real tuning session on transformers' Llama, fewer trials."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_recompute import RecomputePolicy
from tests.helpers import REPO, child_env

pytest.importorskip("transformers")

RECIPE = REPO / "recipes" / "hf-llama-tiny.yaml"


@pytest.mark.slow
def test_hf_llama_tiny_recipe_tunes_and_promotes(tmp_path: Path) -> None:
    recipe = yaml.safe_load(RECIPE.read_text(encoding="utf-8"))
    recipe["search"]["n_trials"] = 3
    recipe["trial"]["measure_steps"] = 2
    recipe["trial"]["timeout_s"] = 400  # a hang deadline: transformers' import alone is slow on a loaded CI node
    path = tmp_path / "hf-llama-tiny.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    env = child_env()
    cli = Path(sys.executable).with_name("recompute-tune")
    proc = subprocess.run(
        [str(cli), str(path), "--format", "json"],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    assert summary["status"] == "promoted"
    measured = [t for t in summary["trials"] if t["outcome"] in ("ok", "over_budget")]
    assert len(measured) == 3, summary["trials"]
    policy = RecomputePolicy.load(tmp_path / "policy.yaml")
    layers = [f"model.model.layers.{i}" for i in range(4)]
    assert set(policy.resolve(layers)) == set(layers)
    # Keeping every activation does not fit the budget, so the promoted policy recomputes something.
    assert any(mode.value != "none" for mode in policy.resolve(layers).values())
