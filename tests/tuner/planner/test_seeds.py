"""The planner's seeds: its pick at the budget, each kind of recomputation's own pick, points of its front."""

from __future__ import annotations

import pytest

from lightning_recompute.planner import Planner
from lightning_recompute.policy import glyph
from lightning_recompute.profile import LayerProfile, Profile, SegmentCost
from tuner._search import LayerInfo, SearchSpace
from tuner._search.planner_seeds import kind_picks, planner_seeds

MODES = ["none", "selective", "full"]


def _seg(delta: int, ms: float) -> SegmentCost:
    return SegmentCost(delta=delta, peak=0, grad=0, seconds=ms / 1e3, scales=True)


def _profile(full_backward_ms: float, selective_backward_ms: float = 2.3) -> Profile:
    """Four identical blocks: none keeps 100 bytes, selective 40, full 10; backward without recompute 2 ms."""
    layers = [
        LayerProfile(
            name=f"blocks.{i}",
            group="g",
            param_bytes=0,
            fwd={"none": _seg(100, 1.0), "selective": _seg(40, 1.0), "full": _seg(10, 1.0)},
            bwd={
                "none": _seg(-100, 2.0),
                "selective": _seg(-40, selective_backward_ms),
                "full": _seg(-10, full_backward_ms),
            },
            net=0,
        )
        for i in range(4)
    ]
    timeline = [f"fwd:{i}" for i in range(4)] + [f"bwd:{i}" for i in reversed(range(4))]
    return Profile(layers, timeline, {}, MODES, 0, 0, 0, 0, 0, 1, "cpu", "measured")


def _space() -> SearchSpace:
    return SearchSpace.for_layers([LayerInfo(f"blocks.{i}", "g") for i in range(4)], MODES)


def _short(modes: dict[str, str]) -> str:
    return "".join(glyph(m) for m in modes.values())


def test_when_the_profile_puts_selective_first_the_full_only_pick_is_seeded_too() -> None:
    """The gpt4 miss: a profile that times selective's recompute cheaper makes ``ss..`` the pick, and
    ``FF..`` is on no front (dominated on paper); it must still get a trial of its own."""
    planner = Planner(_profile(full_backward_ms=2.6))
    seeds, _ = planner_seeds(planner, _space(), 280, MODES)
    named = {s.name: _short(dict(s.modes)) for s in seeds}
    assert named["planner:budget"] == "ss.."
    assert named["planner:full-only"] == "FF.."
    assert "planner:selective-only" not in named  # the pick itself: seeded once
    assert [s.name for s in seeds][:2] == ["planner:budget", "planner:full-only"]  # before the front's points
    assert len({_short(dict(s.modes)) for s in seeds}) == len(seeds)
    # Each kind's pick is the planner's own at the budget with that kind alone.
    assert {k: p.short() for k, p in kind_picks(planner, 280, MODES, None)} == {"selective": "ss..", "full": "FF.."}


def test_when_the_profile_puts_full_first_the_selective_only_pick_is_seeded_instead() -> None:
    seeds, _ = planner_seeds(Planner(_profile(full_backward_ms=2.25)), _space(), 280, MODES)
    named = {s.name: _short(dict(s.modes)) for s in seeds}
    assert (named["planner:budget"], named["planner:selective-only"]) == ("FF..", "ss..")
    assert "planner:full-only" not in named


def test_a_kind_predicted_far_behind_the_pick_is_seeded_all_the_same() -> None:
    """A busy machine can put a kind 45% behind in the profile and still be the fastest: no threshold."""
    planner = Planner(_profile(full_backward_ms=2.25, selective_backward_ms=5.0))
    pick = planner.solve(280)
    (only,) = [p for k, p in kind_picks(planner, 280, MODES, None) if k == "selective"]
    assert only.step_time_s > pick.step_time_s * 1.4
    named = {s.name: _short(dict(s.modes)) for s in planner_seeds(planner, _space(), 280, MODES)[0]}
    assert (named["planner:budget"], named["planner:selective-only"]) == ("FF..", only.short())


def test_a_kind_pick_on_the_front_is_seeded_once_and_the_front_gives_its_other_points() -> None:
    # At 100 bytes the fitting front is FFFF, FFFs, FFss: the pick is FFss and full alone picks FFFF,
    # a front point; seeding it again as a front point would spend a front seed on a duplicate.
    seeds, _ = planner_seeds(Planner(_profile(full_backward_ms=2.6)), _space(), 100, MODES)
    assert [(s.name, _short(dict(s.modes))) for s in seeds] == [
        ("planner:budget", "FFss"),
        ("planner:full-only", "FFFF"),
        ("planner:front1", "FFFs"),
    ]


@pytest.mark.parametrize(
    ("modes", "budget", "expected"),
    [
        (["selective", "full"], 280, {}),  # without none a kind alone is a uniform policy: a baseline measures it
        (MODES, 150, {"full": "FFF."}),  # selective keeps 40 a block: 160 at least, over 150, so it is left out
    ],
)
def test_kind_picks_leave_out_what_the_baselines_measure_and_what_cannot_fit(
    modes: list[str], budget: int, expected: dict[str, str]
) -> None:
    planner = Planner(_profile(full_backward_ms=2.6))
    assert {k: p.short() for k, p in kind_picks(planner, budget, modes, None)} == expected
