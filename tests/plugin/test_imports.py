"""The package imports lazily: reading policies (and the tuner's ``schema``) loads no Lightning or MLflow."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest

import lightning_recompute
from tests.helpers import REPO

HEAVY = ("lightning", "pytorch_lightning", "mlflow", "torch")


def loaded_after(code: str) -> list[str]:
    """Which of `HEAVY` a fresh interpreter has imported after running ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "code",
    [
        "import lightning_recompute",
        "import lightning_recompute.policy",
        "from lightning_recompute import RecomputePolicy, PolicyError, Mode, __version__",
        "from lightning_recompute.safe_yaml import load_document",
        "from lightning_recompute.modes import MODES",
        "import lightning_recompute.mlflow_policy",
        "from lightning_recompute.policy import RecomputePolicy\n"
        "RecomputePolicy.from_dict({'version': 1, 'layers': {'h.*': 'full'}}).to_yaml()",
        "from lightning_recompute.policy import RecomputePolicy\n"
        "RecomputePolicy.from_dict({'version': 1, 'layers': {'h.0': 'selective:attn'}}).short(['h.0'])",
    ],
)
def test_policy_side_loads_no_lightning_mlflow_or_torch(code: str) -> None:
    assert loaded_after(code) == []


@pytest.mark.slow
def test_the_callback_still_imports_on_first_use() -> None:
    assert loaded_after("from lightning_recompute import RecomputeCallback") == ["lightning", "torch"]


@pytest.mark.slow
def test_recipe_schema_command_loads_no_lightning_or_mlflow() -> None:
    probe = (
        "import io, json, runpy, sys, contextlib\n"
        "sys.argv = ['recompute-tune', 'schema']\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "    runpy.run_module('tuner', run_name='__main__')\n"
        "assert '\"properties\"' in out.getvalue(), out.getvalue()[:500]"
    )
    assert [m for m in loaded_after(probe) if m != "torch"] == []


def test_every_public_name_resolves_and_is_listed() -> None:
    for name in lightning_recompute.__all__:
        assert getattr(lightning_recompute, name) is not None, name
    assert set(lightning_recompute.__all__) <= set(dir(lightning_recompute))
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        _ = lightning_recompute.nope  # type: ignore[attr-defined]  # the point: an unknown name


def test_version_comes_from_the_installed_metadata() -> None:
    assert lightning_recompute.__version__ == importlib.metadata.version("lightning-recompute")
