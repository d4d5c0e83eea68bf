"""The library stands alone: a training job that installed ``lightning-recompute`` without the ``tune`` extra
imports `RecomputeCallback` and `AutoRecompute` and tunes in the job, with optuna, mlflow, pydantic and the
service absent (a fresh interpreter where importing them fails, as for a package not installed)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import REPO

SERVICE = ("optuna", "mlflow", "pydantic", "tuner")

JOB = textwrap.dedent(
    """
    import json, sys, warnings

    for name in {service!r}:
        sys.modules[name] = None  # `import name` raises ImportError, find_spec answers None: as if not installed

    import lightning as L
    from lightning_recompute import AutoRecompute, RecomputeCallback
    from lightning_recompute.race import RacePlan
    from lightning_recompute.reference import ReferenceGPT, SyntheticTokens

    L.seed_everything(0, verbose=False)
    plan = RacePlan(steps=1, min_rounds=2, max_rounds=3, time_s=1e9, estimate_rounds=2, warmup_steps=1)
    auto = AutoRecompute("1GiB", plan=plan, profile_repeats=1, output={output!r}, tracking_uri={uri!r})
    trainer = L.Trainer(
        max_steps=16, callbacks=[auto], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(
            ReferenceGPT(vocab_size=64, seq_len=32, n_layer=3, n_embd=32, n_head=4),
            datamodule=SyntheticTokens(vocab_size=64, seq_len=32, batch_size=4, num_batches=32),
        )
    print(json.dumps({{
        "decided": auto.decision is not None,
        "loaded": sorted(m for m in {service!r} if sys.modules.get(m) is not None),
        "warnings": [str(w.message) for w in caught if "MLflow" in str(w.message)],
    }}))
    """
)


@pytest.mark.slow
def test_a_job_without_the_tune_extra_tunes_writes_its_policy_and_says_the_record_needs_the_extra(
    tmp_path: Path,
) -> None:
    output = tmp_path / "policy.yaml"
    code = JOB.format(service=SERVICE, output=str(output), uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["decided"]
    assert found["loaded"] == []
    assert output.exists()
    assert any("lightning-recompute[tune]" in w for w in found["warnings"]), found["warnings"]
    assert not (tmp_path / "mlflow.db").exists()


def test_recompute_tune_without_the_tune_extra_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    from tuner import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "optuna" else real(name, *a))
    assert cli.command() == 2
    err = capsys.readouterr().err
    assert "needs optuna" in err
    assert "pip install 'lightning-recompute[tune]'" in err
