"""Numerics: every mode against no recompute, by the gate's own rule (the trial worker's numerics check)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from lightning_recompute import RecomputePolicy
from lightning_recompute.profile import ALL_MODES
from tests.gpu.common import Device, layer_names, mixed, quiet, recipe_dict


def _worker_numerics(
    recipe: Mapping[str, Any], policy: RecomputePolicy, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    """The trial worker's ``numerics`` kind (the gate's rule), run in this process by the worker's entry point."""
    from tuner._trials import worker

    spec_path, result_path = folder / "spec.json", folder / "result.json"
    spec: dict[str, Any] = {
        "kind": "numerics",
        "recipe": dict(recipe),
        "source": None,
        "policy": policy.to_dict(),
        "sys_path": [],
    }
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    result_path.unlink(missing_ok=True)
    # No parent to follow: this process is no worker. The worker records itself as the parent of ranks it
    # might start; set (not deleted: deleting an unset variable records nothing to undo), so the test's
    # end puts it back, and a pid another test left here cannot make the worker take it for a dead parent.
    monkeypatch.setenv("RECOMPUTE_TUNE_PARENT_PID", "")
    code = worker.main([str(spec_path), str(result_path)])
    result: dict[str, Any] = json.loads(result_path.read_text(encoding="utf-8"))
    result["exit_code"] = code
    return result


def test_numerics_of_every_mode_equal_no_recompute(
    device: Device, figures: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every mode and a mixed policy, SDPA on its default backends, in bf16-mixed (flash kernels) and fp32
    (memory-efficient ones) on CUDA, fp32 on CPU: equal to no recompute by the gate's rule, bitwise where
    the kernels are deterministic, else within the spread of two runs without recompute (both recorded)."""
    sz = device.sizes
    policies = {m: RecomputePolicy.uniform(m) for m in ALL_MODES}
    policies["mixed"] = mixed(layer_names(sz.numerics_model))
    rows: dict[str, dict[str, Any]] = {}
    figures["precisions"] = rows
    failed: list[str] = []
    for precision in sz.numerics_precisions:
        recipe = recipe_dict(sz.numerics_model, sz.numerics_batch, device.type, precision)
        rows[precision] = {}
        for label, policy in policies.items():
            with quiet():
                res = _worker_numerics(recipe, policy, tmp_path, monkeypatch)
            device.release()
            if res.get("outcome") != "ok":
                # One mode that cannot run (an OOM, an error) is that mode's failure; the others still say theirs.
                rows[precision][label] = {"equal": False, "outcome": res.get("outcome"), "error": res.get("error")}
                failed.append(f"{precision}/{label} ({res.get('outcome')}: {res.get('error')})")
                continue
            rows[precision][label] = {k: res.get(k) for k in ("equal", "max_abs_diff", "baseline_spread", "detail")}
            if not res["equal"]:
                failed.append(
                    f"{precision}/{label} (policy vs no recompute {res['max_abs_diff']:.3g}, "
                    f"no recompute vs itself {res['baseline_spread']:.3g})"
                )
    assert not failed, f"not equal to no recompute: {', '.join(failed)}"
    if not device.cuda:
        (fp32,) = rows.values()
        assert set(fp32) == {*ALL_MODES, "mixed"}
        assert all(m["max_abs_diff"] == 0.0 and m["baseline_spread"] == 0.0 for m in fp32.values()), fp32  # bitwise
