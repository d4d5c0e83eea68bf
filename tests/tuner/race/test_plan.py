"""`Recipe.race_plan`: the race's budget follows the search's cost, within a floor."""

from __future__ import annotations

import pytest

from tuner.recipe import from_dict
from tuner.recipe._schema import RecipeError


def _recipe(tmp_path, **race):
    data = {"model": {"init_args": {"n_layer": 2}}, "budget": "20MiB", "race": race}
    return from_dict(data, source=tmp_path / "recipe.yaml")


@pytest.mark.parametrize(
    ("race", "search_s", "total_s"),
    [
        ({}, 400.0, 100.0),  # a long search: race.share (25%) of it
        ({}, 12.0, 30.0),  # a dozen forked trials: the share would be 3 s; race.min_s (30 s) instead
        ({"min_s": 0}, 12.0, 3.0),  # no floor: the share alone
        ({"min_s": 50, "share": 0.5}, 200.0, 100.0),
        ({"share": None}, 400.0, None),  # no share: only time_s and max_rounds bound the race
        ({}, None, None),  # no search measured (a rerun that only gates): no budget
    ],
)
def test_the_race_budget_is_a_share_of_the_search_never_under_min_s(tmp_path, race, search_s, total_s) -> None:
    plan = _recipe(tmp_path, **race).race_plan(search_s=search_s)
    assert plan.total_s == total_s


def test_a_negative_min_s_names_the_key(tmp_path) -> None:
    with pytest.raises(RecipeError, match=r"race\.min_s: input should be greater than or equal to 0 \(got -1\)"):
        _recipe(tmp_path, min_s=-1)
