"""`Recipe.race_plan`: the recipe's race knobs on `RacePlan`'s constants; the budget follows the search's cost,
within a floor; an earlier recipe's retired race keys still load, with a warning naming them."""

from __future__ import annotations

import json

import pytest

from lightning_recompute.race import RacePlan
from tests.helpers import RACE_PLAN_ENV
from tuner.recipe import RecipeError, from_dict


def _recipe(tmp_path, **race):
    data = {"model": {"init_args": {"n_layer": 2}}, "budget": "20MiB", "race": race}
    return from_dict(data, source=tmp_path / "recipe.yaml")


@pytest.fixture(autouse=True)
def _no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RACE_PLAN_ENV, raising=False)


@pytest.mark.parametrize(
    ("race", "override", "search_s", "total_s"),
    [
        ({}, {}, 400.0, 100.0),  # a long search: race.share (25%) of it
        ({}, {}, 12.0, 30.0),  # a dozen forked trials: the share would be 3 s; the floor (30 s) instead
        ({}, {"min_s": 0}, 12.0, 3.0),  # no floor: the share alone
        ({"share": 0.5}, {"min_s": 50}, 200.0, 100.0),
        ({"share": None}, {}, 400.0, None),  # no share: only time_s and max_rounds bound the race
        ({}, {}, None, None),  # no search measured (a rerun that only gates): no budget
    ],
)
def test_the_race_budget_is_a_share_of_the_search_never_under_its_floor(
    tmp_path, monkeypatch, race, override, search_s, total_s
) -> None:
    if override:
        monkeypatch.setenv(RACE_PLAN_ENV, json.dumps(override))
    plan = _recipe(tmp_path, **race).race_plan(search_s=search_s)
    assert plan.total_s == total_s


def test_the_recipes_knobs_set_the_plan_and_the_rest_are_the_races_constants(tmp_path) -> None:
    plan = _recipe(tmp_path, leaders=2, confidence=0.9, share=0.5).race_plan()
    assert (plan.leaders, plan.confidence, plan.share) == (2, 0.9, 0.5)
    defaults = RacePlan()
    assert (plan.min_rounds, plan.max_rounds, plan.estimate_rounds) == (
        defaults.min_rounds,
        defaults.max_rounds,
        defaults.estimate_rounds,
    )


def test_an_earlier_recipes_retired_race_keys_load_with_a_warning_naming_them(tmp_path) -> None:
    with pytest.warns(UserWarning, match=r"race\.max_rounds, race\.min_s: no longer recipe settings, ignored"):
        recipe = _recipe(tmp_path, min_s=10, max_rounds=5, leaders=3)
    assert recipe.race.leaders == 3 and recipe.race_plan().max_rounds == RacePlan().max_rounds


def test_a_bad_knob_names_the_key(tmp_path) -> None:
    with pytest.raises(RecipeError, match=r"race\.share: input should be greater than 0 \(got -1\)"):
        _recipe(tmp_path, share=-1)


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ('{"processes": 1}', r"'processes' not RacePlan fields \(valid: .*min_rounds"),
        ("{min_rounds: 2", "not JSON"),
        ("[2]", "not a JSON object"),
    ],
)
def test_a_race_override_that_is_not_racePlan_fields_is_refused_naming_them(tmp_path, monkeypatch, override, said):
    from lightning_recompute.errors import RecomputeError

    monkeypatch.setenv(RACE_PLAN_ENV, override)
    with pytest.raises(RecomputeError, match=rf"RECOMPUTE_TUNE_RACE_PLAN: .*{said}"):
        _recipe(tmp_path).race_plan()
