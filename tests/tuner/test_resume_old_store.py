"""A study and an MLflow store written by the tuner before the rebuild (commit 6d8500e, kept in
tests/data/store-6d8500e: five trials, a race across two processes, a promotion) resume under today's code:
the recipe still loads (its retired ``race.processes`` with a warning), the records, the race and the good
policy read back, and a session adds trials and decides."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lightning_recompute.policy import RecomputePolicy
from lightning_recompute.race import RaceResult
from tests.helpers import REPO
from tuner import session
from tuner._search.space import Source
from tuner._tracking import open_tracker
from tuner._tracking.registry import DecisionKind
from tuner.recipe import load

OLD = REPO / "tests" / "data" / "store-6d8500e"


@pytest.fixture
def old_store(tmp_path: Path) -> Path:
    folder = tmp_path / "store"
    shutil.copytree(OLD, folder)
    return folder


def test_a_store_written_before_the_rebuild_resumes(old_store: Path, fakes) -> None:
    with pytest.warns(UserWarning, match=r"race\.processes: no longer recipe settings"):
        recipe = load(old_store / "recipe.yaml")
    tracker = open_tracker(recipe.tracking.uri, str(recipe.tracking.experiment))
    good = tracker.registry.current_good()
    assert good is not None and good.policy == RecomputePolicy.load(old_store / "policy.yaml")
    (decision,) = tracker.registry.history()
    assert decision.kind is DecisionKind.PROMOTE
    (race_file,) = old_store.glob("mlartifacts/resume/*/artifacts/race.json")
    race = RaceResult.from_dict(json.loads(race_file.read_text()))
    assert race.ok and race.winner == good.fingerprint and race.vs

    summary = session.tune(recipe, n_trials=7, use_planner=False, handle_signals=False)
    assert summary.trials_this_session == 2 and len([r for r in summary.records if r.ran]) == 7
    assert {r.source for r in summary.records} >= {Source.BASELINE}
    assert summary.baselines["full"].label == "baseline:full"
    assert summary.status in ("promoted", "current") and summary.exit_code == 0
    assert (
        RecomputePolicy.load(recipe.output).fingerprint()
        == open_tracker(recipe.tracking.uri, str(recipe.tracking.experiment)).registry.current_good().fingerprint
    )
