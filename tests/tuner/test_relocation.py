"""A results folder (recipe, SQLite tracking database, artifacts, policy) keeps working after a move or copy.

MLflow records absolute artifact paths. Before the fix, after ``mv run1 run2``: ``history`` raised,
the gate found no policy artifact, the ``mlflow:`` source failed, and logging recreated run1's
``mlartifacts``; a copied folder wrote into the original's.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path

import pytest
from mlflow import MlflowClient

from lightning_recompute.mlflow_policy import load_good_policy
from lightning_recompute.policy import RecomputePolicy
from tests.tuner.fakes import GATE_LAYERS as LAYERS
from tests.tuner.fakes import FixedTrials, numerics
from tuner import _commands as commands
from tuner import recipe as recipe_mod
from tuner._gate import Candidate, decide
from tuner._tracking import Tracker

A = RecomputePolicy.uniform("full")
B = RecomputePolicy.first_n(LAYERS, 1, "selective")
LIMIT = 100 * 2**20


def make_recipe(folder: Path) -> recipe_mod.Recipe:
    return recipe_mod.from_dict(
        {
            "name": "moved",
            "budget": "128MiB",
            "model": {"init_args": {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 16, "vocab_size": 64}},
            "trial": {"warmup_steps": 1, "measure_steps": 4, "timeout_s": 30},
            "tracking": {"uri": f"sqlite:///{folder / 'mlflow.db'}", "experiment": "moved"},
            "output": str(folder / "policy.yaml"),
        },
        source=folder / "recipe.yaml",
    )


def promote_twice(folder: Path, empty_db: Path) -> None:
    folder.mkdir()
    shutil.copy(empty_db, folder / "mlflow.db")
    recipe = make_recipe(folder)
    tracker = Tracker(recipe.tracking.uri, "moved")
    for policy, speed in ((A, 100.0), (B, 200.0)):
        with tracker.sessions.session(recipe, study_name="s"):
            trials = FixedTrials({A: 100.0, B: speed})
            d = decide(
                tracker,
                Candidate(policy, layer_names=LAYERS),
                recipe=recipe,
                budget_bytes=LIMIT,
                run_trial=trials,
                check_numerics=numerics(),
                run_race=trials.run_race,
            )
        assert d.promoted


def tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def moved(tmp_path: Path, empty_db: Path) -> Path:
    promote_twice(tmp_path / "run1", empty_db)
    shutil.move(tmp_path / "run1", tmp_path / "run2")
    return tmp_path / "run2"


def test_the_mlflow_source_reads_a_moved_folder_without_writing(moved: Path) -> None:
    before = tree(moved)
    assert load_good_policy("moved", f"sqlite:///{moved / 'mlflow.db'}") == B
    assert not (moved.parent / "run1").exists()
    assert tree(moved) == before


def test_history_rollback_and_the_gate_work_in_a_moved_folder(moved: Path) -> None:
    recipe = make_recipe(moved)
    summary = commands.history(recipe)
    assert [d.kind for d in summary.decisions] == ["promote", "promote"]
    assert summary.current is not None and summary.current.policy == B
    # `history --format json`: datetimes in ISO 8601, not Python reprs.
    decisions = json.loads(json.dumps(summary.to_dict()))["decisions"]
    assert [datetime.fromisoformat(d["at"]) for d in decisions] == [d.at for d in summary.decisions]

    done = commands.rollback(recipe)
    assert done.rolled_back and done.good.policy == A and RecomputePolicy.load(moved / "policy.yaml") == A
    # The records now name the new folder: MLflow's own download finds the artifacts.
    client = MlflowClient(tracking_uri=recipe.tracking.uri)
    exp = client.get_experiment_by_name("moved")
    assert exp is not None and exp.artifact_location == str(moved / "mlartifacts" / "moved")
    runs = client.search_runs([exp.experiment_id])
    assert runs and all(r.info.artifact_uri.startswith(str(moved / "mlartifacts")) for r in runs)
    assert load_good_policy("moved", recipe.tracking.uri) == A
    assert not (moved.parent / "run1").exists()  # nothing recreated at the old path


def test_a_copied_folder_writes_into_its_own_artifacts_not_the_original(moved: Path) -> None:
    copy = moved.parent / "run3"
    shutil.copytree(moved, copy)
    original = tree(moved)
    recipe = make_recipe(copy)
    commands.rollback(recipe)  # logs a decision run with artifacts
    assert tree(moved) == original
    assert len(tree(copy)) > len(original)
    assert load_good_policy("moved", recipe.tracking.uri) == A
    assert load_good_policy("moved", f"sqlite:///{moved / 'mlflow.db'}") == B  # the original is untouched
