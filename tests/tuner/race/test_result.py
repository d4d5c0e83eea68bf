"""`lightning_recompute.race.result.RaceResult`: the figures' wording and its record."""

from __future__ import annotations

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
    assert race.headlines() == [f"FF.. vs baseline full FFFF: {format_gain(race.vs[FULL])}"]
    assert format_gain(race.vs[FULL]) == "+12.0% (99% CI +4.0..+25.0%, interleaved, 8 rounds)"
    assert RaceResult.from_dict(race.to_dict()) == race


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
