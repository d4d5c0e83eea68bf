"""The mode vocabulary (`lightning_recompute.modes`): the registry itself and the plugin's views of it.

Adding a save-list family is one `ModeSpec` in `lightning_recompute.modes.MODES` plus its row in
`EXPECTED` below; every other test here (and ``tests/tuner/test_mode_views.py``) follows the registry.
"""

from __future__ import annotations

import re

import pytest

import lightning_recompute
from lightning_recompute import selective
from lightning_recompute.errors import PolicyError
from lightning_recompute.modes import (
    BY_MEMORY_SAVED,
    DEFAULT_SAVE_OPS,
    FAMILY_NAMES,
    MODE_NAMES,
    MODES,
    SAVE_FAMILIES,
    UNKNOWN_GLYPH,
    Mode,
    ModeSpec,
)
from lightning_recompute.policy import RecomputePolicy, glyph

EXPECTED = {
    # name: (glyph, saving rank, recompute weight, planner label)
    "none": (".", 0, 0, "none"),
    "selective": ("s", 1, 2, "sel"),
    "full": ("F", 6, 3, "full"),
    "offload": ("o", 5, 1, "off"),
    "selective:attn": ("a", 4, 2, "attn"),
    "selective:attn+wide": ("w", 2, 2, "attn+wide"),
    "selective:attn+narrow": ("n", 3, 2, "attn+narrow"),
}
"""Every mode and what it stands for, pinned: the glyphs are in logs and MLflow records, the ranks
decide the search space's order and the race's tie-break."""


def test_the_registry_is_what_is_pinned() -> None:
    assert {s.name: (s.glyph, s.saving, s.recompute, s.label) for s in MODES} == EXPECTED
    assert list(MODE_NAMES) == list(EXPECTED)  # the canonical order: the schema's, the profile's, the planner's


def test_every_mode_has_one_name_and_one_glyph() -> None:
    assert len(set(MODE_NAMES)) == len(MODES)
    glyphs = [s.glyph for s in MODES]
    assert len(set(glyphs)) == len(glyphs), glyphs
    assert all(len(g) == 1 and not g.isspace() for g in glyphs)
    assert UNKNOWN_GLYPH not in glyphs


def test_the_plugin_modes_come_first_in_enum_order_then_the_families() -> None:
    plain = [s for s in MODES if not s.is_family]
    assert [s.mode for s in plain] == list(Mode)
    assert [s.name for s in plain] == [m.value for m in Mode]
    assert MODES[: len(plain)] == tuple(plain)


def test_families_are_selective_with_a_save_list() -> None:
    for s in MODES:
        if s.is_family:
            assert s.mode is Mode.SELECTIVE and s.name == f"selective:{s.family}"
            assert s.save, s.name
        elif s.mode is Mode.SELECTIVE:
            assert s.save == DEFAULT_SAVE_OPS
        else:
            assert s.save is None, s.name
    assert tuple(SAVE_FAMILIES) == FAMILY_NAMES == tuple(s.family for s in MODES if s.is_family)


def test_ranks_order_the_modes() -> None:
    assert sorted(s.saving for s in MODES) == list(range(len(MODES)))  # a strict order, no ties
    assert BY_MEMORY_SAVED[0] == Mode.NONE.value and BY_MEMORY_SAVED[-1] == Mode.FULL.value
    saving = {s.name: s.saving for s in MODES}
    assert [saving[n] for n in BY_MEMORY_SAVED] == list(range(len(MODES)))
    weights = {s.name: s.recompute for s in MODES}
    assert weights["none"] == 0 and weights["full"] == max(weights.values())


# ---------------------------------------------------------------------- the plugin's views


@pytest.mark.parametrize("s", MODES, ids=MODE_NAMES)
def test_a_policy_writes_reads_and_draws_every_mode(s: ModeSpec) -> None:
    name = s.name
    policy = RecomputePolicy.uniform(name)
    assert policy.choice_for("blocks.0") == name
    assert policy.mode_for("blocks.0") is s.mode
    assert policy.family_for("blocks.0") == s.family
    assert policy.short(["blocks.0", "blocks.1"]) == s.glyph * 2
    assert glyph(name) == s.glyph
    assert RecomputePolicy.from_dict(policy.to_dict()) == policy


def test_an_unknown_choice_has_the_unknown_glyph() -> None:
    assert glyph("selective:nope") == glyph("bogus") == UNKNOWN_GLYPH


def test_mode_parsing_and_family_errors_name_the_registry() -> None:
    with pytest.raises(PolicyError, match=r"valid modes are: none, selective, full, offload$"):
        Mode.parse("bogus", where="x")
    with pytest.raises(PolicyError, match=re.escape(f"valid families are: {', '.join(FAMILY_NAMES)}")):
        RecomputePolicy.from_modes({"a": "selective:nope"})


def test_the_old_import_paths_still_work() -> None:
    from lightning_recompute.policy import Mode as PolicyMode

    assert PolicyMode is Mode is lightning_recompute.Mode
    assert selective.SAVE_FAMILIES is SAVE_FAMILIES
    assert selective.DEFAULT_SAVE_OPS is DEFAULT_SAVE_OPS is lightning_recompute.DEFAULT_SAVE_OPS


def test_every_save_list_resolves() -> None:
    assert selective.resolve_save_ops(None)
    for family in FAMILY_NAMES:
        assert selective.resolve_save_ops(None, family=family), family
