"""`bench/seed_coverage.py`: the fastest policy among the planner's seeds, now and before the kind picks."""

from __future__ import annotations

from bench import seed_coverage as sc
from lightning_recompute.planner import Planner
from tests.tuner.planner.test_seeds import MODES, _profile


def test_coverage_counts_the_profiles_whose_seeds_hold_the_best_now_and_before() -> None:
    rows = [
        {"seeds": {"planner:budget": "FF..", "planner:selective-only": "ss.."}, "before": ["FF..", "FFF."]},
        {"seeds": {"planner:budget": "ss..", "planner:full-only": "FF.."}, "before": ["ss..", "Fss."]},
        {"seeds": {"planner:budget": "ss..", "planner:front1": "Fss."}, "before": ["ss..", "Fss."]},
    ]
    got = sc.coverage(rows, "FF..")
    assert (got["profiles"], got["best_seeded"], got["best_seeded_before"]) == (3, 2, 1)
    assert got["picks"] == {"FF..": 1, "ss..": 2}
    assert got["seeded_by"] == {"planner:budget": 1, "planner:full-only": 1, "-": 1}


def test_the_seeds_before_the_kind_picks_are_the_pick_and_the_fronts_points() -> None:
    # The profile that ranks selective first: the pick is ss.., FF.. is on no front, so it was not seeded.
    before = sc.seeds_before_kind_picks(Planner(_profile(full_backward_ms=2.6)), 280, MODES)
    assert before[0] == "ss.." and "FF.." not in before and len(before) == 4
