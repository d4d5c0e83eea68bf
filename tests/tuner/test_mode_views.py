"""The tuner's views of the mode vocabulary agree with `lightning_recompute.modes.MODES`.

The recipe schema, the search space's order, the race's recompute strength, the profile's modes and
the planner's table all derive from the registry; these tests fail if one of them spells its own.
"""

from __future__ import annotations

import itertools
import re

import pytest

from lightning_recompute.errors import RecomputeError
from lightning_recompute.modes import BY_MEMORY_SAVED, FAMILY_NAMES, MODE_NAMES, MODES, Mode
from lightning_recompute.planner.report import _count_name
from lightning_recompute.policy import RecomputePolicy
from lightning_recompute.profile import ALL_MODES
from lightning_recompute.profile.model import BASE_MODES, FAMILY_MODES
from lightning_recompute.race.rule import recompute_strength
from tuner._search.space import LayerInfo, SearchSpace
from tuner.recipe import from_dict, json_schema

NAMES = [f"blocks.{i}" for i in range(3)]


def test_the_recipe_schema_lists_exactly_the_registry_s_modes() -> None:
    modes = json_schema()["$defs"]["SearchSettings"]["properties"]["modes"]
    assert modes["items"]["enum"] == list(MODE_NAMES)
    assert modes["description"].endswith(f"{', '.join(FAMILY_NAMES)}.")


def test_a_recipe_accepts_every_mode_and_names_them_all_when_one_is_wrong() -> None:
    budget = {"budget": "1GiB", "trainer": {"accelerator": "cuda"}}
    assert from_dict({**budget, "search": {"modes": list(MODE_NAMES)}}).search.modes == MODE_NAMES
    with pytest.raises(RecomputeError, match=re.escape(f"valid: {', '.join(MODE_NAMES)}")):
        from_dict({**budget, "search": {"modes": ["none", "sel"]}})


def test_the_search_space_orders_modes_by_memory_saved() -> None:
    saving = {s.name: s.saving for s in MODES}
    layers = [LayerInfo(n, "k") for n in NAMES]
    for r in range(1, len(MODES) + 1):
        for modes in itertools.combinations(MODE_NAMES, r):
            space = SearchSpace.for_layers(layers, modes)
            assert space.fill_mode == min(modes, key=saving.__getitem__)
            ranks = [saving[m] for m in space.counted_modes]
            assert ranks == sorted(ranks, reverse=True)  # strongest first
    with pytest.raises(RecomputeError, match=re.escape(f"one or more of {', '.join(BY_MEMORY_SAVED)}")):
        SearchSpace.for_layers(layers, ["none", "nope"])


def test_the_race_weighs_each_mode_by_what_it_recomputes() -> None:
    for s in MODES:
        short = RecomputePolicy.uniform(s.name).short(NAMES)
        full = len(NAMES) if s.mode is Mode.FULL else 0
        assert recompute_strength(short) == (full, s.recompute * len(NAMES)), s.name
    assert recompute_strength("?") == (0, max(s.recompute for s in MODES))  # no mode: counted as the most


def test_the_profile_and_the_planner_follow_the_registry() -> None:
    assert ALL_MODES == MODE_NAMES
    assert tuple(m.value for m in Mode) == BASE_MODES
    assert tuple(s.name for s in MODES if s.is_family) == FAMILY_MODES
    assert [_count_name(m) for m in ALL_MODES] == [s.label for s in MODES]
