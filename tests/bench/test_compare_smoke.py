"""The comparison benchmark's smoke version: every method has a row, fits and ratios are computed.

Runs ``bench/compare.py --smoke`` as the user would (a subprocess: the benchmark sets torch's
thread count and logging for its whole process) on a tiny model at one budget, with two tuner
trials, so the benchmark cannot rot unnoticed. Not a performance test: no figure is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

METHODS = (
    "none",
    "full",
    "every-k",
    "selective-attn",
    "op-sac",
    "sqrt-n",
    "compile",
    "torch-sac-ilp",
    "planner",
    "tuned",
)


@pytest.mark.slow
def test_compare_smoke_has_every_method_and_computes_fits_and_ratios(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "compare.py"),
            "--smoke",
            "--out",
            str(tmp_path),
            "--plots",
            str(tmp_path),
        ],
        check=False,  # the assertion below shows stderr, which check=True would not
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=800,  # a hang deadline: the smoke runs a whole tuning session and every method
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "compare-smoke.json").read_text())
    (workload,) = result["workloads"]
    rows = workload["rows"]
    budgets = {r["budget"] for r in rows}
    assert budgets, "no budget rows"
    for budget in budgets:
        methods = [r["method"] for r in rows if r["budget"] == budget]
        assert sorted(methods) == sorted(METHODS), methods
    measured = [r for r in rows if r["peak_bytes"] is not None]
    # none, full, selective-attn, op-sac and sqrt-n always run; each has a peak and a verdict.
    assert {"none", "full", "selective-attn", "op-sac", "sqrt-n"} <= {r["method"] for r in measured}
    for r in measured:
        assert r["fits"] == (r["peak_bytes"] <= workload["budgets"][str(r["budget"])])
    # A row that is not measured says why.
    for r in rows:
        if r["peak_bytes"] is None:
            assert r["note"], r
    tuned = [r for r in rows if r["method"] == "tuned"]
    assert all(r["tokens_per_s"] for r in tuned), "the tuner promoted nothing on the smoke workload"
    for r in rows:
        if r["tokens_per_s"] is not None:
            assert r["ratio"] is not None and r["ratio"] > 0
    assert all(r["ratio"] == 1.0 for r in tuned)
    text = (tmp_path / "compare-smoke.txt").read_text()
    for method in METHODS:
        assert f"\n{method} " in text
