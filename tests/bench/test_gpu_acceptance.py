"""The GPU acceptance script's CPU dry run (``bench/gpu_acceptance.py --device cpu``), so the script
cannot rot before a GPU is lent to run it.

The fast test calls the script's ``main`` in this process: the session check starts a tuning
session (processes), so there it is replaced by one that raises, which also proves a check that
raises is reported and the checks after it still run. The slow test runs the session check itself.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from lightning_recompute.profile import ALL_MODES
from tests.helpers import REPO


@pytest.fixture(scope="module")
def acceptance() -> Iterator[ModuleType]:
    """``bench/gpu_acceptance.py`` as a module (bench/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_acceptance", REPO / "bench" / "gpu_acceptance.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _report(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    report = json.loads(path.read_text(encoding="utf-8"))
    return report, {c["name"]: c for c in report["checks"]}


def test_dry_run_passes_every_cpu_check_and_a_raising_check_stops_nothing(
    acceptance: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "results.json"
    partial: dict[str, Any] = {}

    def session_raises(ctx: Any) -> Any:
        partial.update(json.loads(out.read_text(encoding="utf-8")))  # what a run cut short here would leave
        raise RuntimeError("not in the fast tier: a tuning session starts processes")

    monkeypatch.setitem(acceptance.CHECKS, "session", (acceptance.CHECKS["session"][0], session_raises))
    level = logging.getLogger("lightning.pytorch").level
    code = acceptance.main(["--device", "cpu", "--json", str(out)])
    printed = capsys.readouterr().out
    assert logging.getLogger("lightning.pytorch").level == level  # quietened for the run only

    assert code == 1  # the raising check fails the run
    report, checks = _report(out)
    assert list(checks) == list(acceptance.CHECK_NAMES)  # the checks after the raising one ran too
    assert checks["session"]["status"] == "error"
    assert "starts processes" in checks["session"]["summary"]
    for name, check in checks.items():
        if name != "session":
            assert check["status"] == "pass", check
            assert check["seconds"] > 0
    assert report["passed"] is False and report["complete"] is True
    assert partial["complete"] is False and [c["name"] for c in partial["checks"]] == ["meter", "numerics", "offload"]
    assert report["environment"]["torch"] == torch.__version__

    # What each check compared, not only that it said "pass".
    meter = checks["meter"]["figures"]
    assert set(meter["policies"]) == {"none", "selective", "full", "offload", "mixed"}
    peaks = {k: v["meter_bytes"] for k, v in meter["policies"].items()}
    assert peaks["full"] < peaks["selective"] < peaks["none"] == peaks["offload"]  # offload is none on CPU
    assert all(v["rel_error"] <= 0.005 for v in meter["policies"].values())

    (numerics,) = checks["numerics"]["figures"]["precisions"].values()  # fp32 on CPU
    assert set(numerics) == {*ALL_MODES, "mixed"}
    assert all(m["equal"] and m["max_abs_diff"] == 0.0 and m["baseline_spread"] == 0.0 for m in numerics.values())

    offload = checks["offload"]["figures"]
    assert offload["offloadable_bytes"] > 0 and offload["expected_drop_bytes"] == 0 and offload["drop_bytes"] == 0
    assert all(s["tokens_per_s"] > 0 for s in offload["speed"].values())

    planner = checks["planner"]["figures"]
    assert planner["none_predicted_bytes"] > planner["card_bytes"]  # sized so that keeping everything does not fit
    assert planner["policies"]["planned"]["measured_bytes"] <= planner["budget_bytes"] * 1.03
    assert planner["worst_rel_error"] <= 0.03

    compiled = checks["compile"]["figures"]
    assert compiled["backend"] == "aot_eager" and compiled["weights_within_tolerance"]
    assert compiled["graphs_none"] > 0 and compiled["graphs_full"] > 0  # it compiled, not only ran eagerly
    assert compiled["peak_full_bytes"] < compiled["peak_none_bytes"]

    in_job = checks["in_job"]["figures"]
    # The CPU capped between full's and none's peaks: none ran out of memory for real, both jobs train as a plain run.
    assert in_job["weights_bitwise_equal"] == {"given": True, "planned": True}
    assert in_job["peak_full_bytes"] < in_job["cap_bytes"] < in_job["peak_none_bytes"] and in_job["tuning_steps"] > 0
    assert in_job["none_out"].startswith("out of memory") and set(in_job["chosen"]) == {"F"}
    assert any("does not fit with every layer in none" in n for n in in_job["planned_notes"])

    # Versions first (a partial run is informative), one table last.
    assert printed.startswith("environment: device cpu, torch ")
    table = printed[printed.index("check ") :]
    for name in acceptance.CHECK_NAMES:
        assert f"\n{name} " in table


def test_bad_arguments_are_refused_with_the_valid_choices(
    acceptance: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert acceptance.main(["--device", "cpu", "--only", "meter,gpu"]) == 2
    assert "unknown check 'gpu'; valid: meter, numerics, offload, session, planner, compile" in capsys.readouterr().err
    assert acceptance.main(["--device", "cpu", "--only", "meter", "--skip", "meter"]) == 2
    assert "no check left to run" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert acceptance.main([]) == 2
        assert "no CUDA device is visible; use --device cpu" in capsys.readouterr().err


def test_cuda_sizes_are_what_the_issue_asks(acceptance: ModuleType, tmp_path: Path) -> None:
    """The GPU run's sizes are never run here; on the meta device they are cheap to keep honest."""
    sizes = acceptance.CUDA_SIZES
    with torch.device("meta"):
        meter_model = acceptance.ReferenceGPT(**sizes.model)
    weights = sum(p.numel() * p.element_size() for p in meter_model.parameters())
    assert 100 * 2**20 <= weights <= 1024 * 2**20  # "a model of a few hundred MB" (fp32)
    assert sizes.compile_backend is None  # Inductor, the backend whose buffers the CPU ledger cannot see

    # Check 5 on an 80 GB card: keeping everything does not fit, and the planner finds a policy that does.
    assert sizes.card_bytes is None  # the device's own memory
    card = 80 * 10**9
    ctx = acceptance.Context(torch.device("cpu"), sizes, tmp_path, print)
    one = acceptance.Planner(acceptance._plan_profile(ctx, 1))
    micro_batch = acceptance.plan_micro_batch(one, card)
    plan = one.solve(int(acceptance.PLANNER_BUDGET_FRACTION * card), micro_batch=micro_batch)
    assert set(plan.short()) != {"."} and set(plan.short()) != {"F"}  # recomputes, and not everything


@pytest.mark.slow
def test_session_check_promotes_a_policy_that_recomputes(acceptance: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    assert acceptance.main(["--device", "cpu", "--only", "session", "--json", str(out)]) == 0
    _, checks = _report(out)
    figures = checks["session"]["figures"]
    assert figures["status"] == "promoted" and figures["exit_code"] == 0
    assert figures["promoted_fingerprint"] == figures["policy_file_fingerprint"]
    # The budget sits below none's predicted peak: what is promoted recomputes something.
    assert set(figures["promoted_policy"]) != {"."}
    assert figures["peak_bytes"] <= figures["budget_bytes"]
    assert figures["summary.best"]["throughput"] > 0
