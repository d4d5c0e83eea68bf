"""`lightning_recompute.race.result.RaceResult`: the figures' wording and its record."""

from __future__ import annotations

import dataclasses

from lightning_recompute.race.result import RaceEntrant, RaceResult, format_gain
from lightning_recompute.race.stats import Interval

WIN, FULL = "w", "f"


def _race(vs: Interval, winner: str = WIN) -> RaceResult:
    return RaceResult(
        outcome="ok",
        entrants={
            WIN: RaceEntrant(key=WIN, short="FF..", labels=("trial 3",)),
            FULL: RaceEntrant(key=FULL, short="FFFF", labels=("baseline full",)),
        },
        winner=winner,
        vs={FULL: vs},
        estimate_rounds=vs.rounds,
        tokens_per_step=128,
    )


def test_the_winners_figures_say_their_interval_and_rounds_and_the_record_reads_back_equal() -> None:
    race = _race(Interval(ratio=1.12, low=1.04, high=1.25, rounds=8, confidence=0.99))
    assert race.headlines() == ["FF.. vs baseline full FFFF: +12.0% (95% CI +4.0..+25.0%, interleaved, 8 rounds)"]
    assert RaceResult.from_dict(race.to_dict()) == race


def test_an_interval_is_stated_at_the_confidence_asked_for_or_its_own_coverage_when_that_is_less() -> None:
    """The order-statistics interval's coverage moves in steps (8 rounds: 99%); the progress line, the report
    and MLflow state it at the race's confidence, as one figure. Too few rounds for it state what they reach."""
    covers_more = Interval(ratio=1.12, low=1.04, high=1.25, rounds=8, confidence=0.99)
    assert format_gain(covers_more, 0.95).startswith("+12.0% (95% CI ")
    assert format_gain(covers_more, 0.90).startswith("+12.0% (90% CI ")
    covers_less = Interval(ratio=1.12, low=1.04, high=1.25, rounds=5, confidence=0.9375)
    assert format_gain(covers_less, 0.95).startswith("+12.0% (94% CI ")
    race = dataclasses.replace(_race(covers_more), confidence=0.9)
    assert race.headlines() == ["FF.. vs baseline full FFFF: +12.0% (90% CI +4.0..+25.0%, interleaved, 8 rounds)"]
    assert RaceResult.from_dict(race.to_dict()).confidence == 0.9
    old = race.to_dict()
    del old["confidence"]  # a record from before the field: the default confidence
    assert RaceResult.from_dict(old).confidence == 0.95


def test_a_record_written_when_fresh_processes_raced_the_winner_again_still_reads() -> None:
    """An earlier session's ``race.json`` (MLflow) held each process's figures, the rivals raced again and
    the selection's winner; they read as the race they were, without those fields."""
    race = _race(Interval(ratio=1.1, low=1.0, high=1.2, rounds=16, confidence=0.99))
    old = race.to_dict()
    old["vs"][FULL]["processes"] = 2
    old["vs_processes"] = [{FULL: {**old["vs"][FULL], "rounds": 8, "processes": 1}}] * 2
    old["rechecked"] = {FULL: [1.02, 0.98]}
    old["selected"] = None
    assert RaceResult.from_dict(old) == race
