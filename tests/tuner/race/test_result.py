"""`tuner.race.result.RaceResult`: the figures' wording, several estimation processes, and its record."""

from __future__ import annotations

from tuner.race.result import RaceEntrant, RaceResult, format_gain
from tuner.race.stats import Interval

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


def test_figures_measured_in_several_processes_span_them_and_say_how_many() -> None:
    first = _race(Interval(ratio=1.12, low=1.04, high=1.25, rounds=8, confidence=0.99))
    again = _race(Interval(ratio=1.28, low=1.20, high=1.33, rounds=8, confidence=0.99))
    failed = RaceResult(outcome="failed", reason="killed")
    both = first.estimated_again([again, failed])
    iv = both.vs[FULL]
    assert (iv.low, iv.high, iv.rounds, iv.processes) == (1.04, 1.33, 16, 2)
    assert both.vs_processes == ({FULL: first.vs[FULL]}, {FULL: again.vs[FULL]})
    assert both.headlines() == [f"FF.. vs baseline full FFFF: {format_gain(iv)}"]
    assert format_gain(iv).endswith("CI +4.0..+33.0%, interleaved, 16 rounds in 2 processes)")
    assert format_gain(first.vs[FULL]).endswith("interleaved, 8 rounds)")
    # The record keeps every process's own figures, and reads back equal.
    assert RaceResult.from_dict(both.to_dict()) == both
    # Nothing measured again (failed, or another winner): the race's own figures, unchanged.
    assert first.estimated_again([failed]) is first
    assert first.estimated_again([_race(again.vs[FULL], winner=FULL)]) is first


def test_a_record_written_before_processes_were_counted_reads_as_one_process() -> None:
    old = _race(Interval(ratio=1.1, low=1.0, high=1.2, rounds=8, confidence=0.99)).to_dict()
    del old["vs_processes"]
    for iv in old["vs"].values():
        del iv["processes"]
    read = RaceResult.from_dict(old)
    assert read.vs[FULL].processes == 1 and read.vs_processes == ()
