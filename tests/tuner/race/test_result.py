"""`lightning_recompute.race.result.RaceResult`: the figures' wording, several estimation processes, and its record."""

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


RIVAL = "r"


def _first_race(rival_select: tuple[float, ...]) -> RaceResult:
    """The race's own process: the winner led the selection, the rival was left unresolved."""
    return RaceResult(
        outcome="ok",
        entrants={
            WIN: RaceEntrant(key=WIN, short="FF..", labels=("trial 3",), select_s=(1.0,) * 6, estimate_s=(1.0,) * 8),
            RIVAL: RaceEntrant(key=RIVAL, short="F.F.", labels=("trial 5",), select_s=rival_select),
            FULL: RaceEntrant(
                key=FULL, short="FFFF", labels=("baseline full",), select_s=(1.3,) * 6, estimate_s=(1.3,) * 8
            ),
        },
        winner=WIN,
        leader=WIN,
        tied=(WIN,),
        unresolved=(RIVAL,),
        behind={RIVAL: Interval(ratio=1.02, low=0.95, high=1.09, rounds=6, confidence=0.97)},
        vs={FULL: Interval(ratio=1.3, low=1.25, high=1.35, rounds=8, confidence=0.99)},
        select_rounds=6,
        estimate_rounds=8,
        tokens_per_step=128,
    )


def _again(rival_s: float, full_s: float = 1.3, winner: str = WIN, rounds: int = 8) -> RaceResult:
    """A fresh estimation process: the winner (1 s a round), the rival and full in every round."""
    times = {winner: 1.0, RIVAL: rival_s, FULL: full_s} if winner == WIN else {RIVAL: 1.0, FULL: full_s}
    return RaceResult(
        outcome="ok",
        entrants={k: RaceEntrant(key=k, short=k, labels=(), estimate_s=(t,) * rounds) for k, t in times.items()},
        winner=winner,
        vs={FULL: Interval(ratio=full_s / times[winner], low=full_s, high=full_s, rounds=rounds, confidence=0.99)},
        estimate_rounds=rounds,
    )


def test_a_rival_slower_across_processes_leaves_the_winner_and_its_figures_span_every_process() -> None:
    first = _first_race((1.02,) * 6)
    both = first.estimated_again(
        [_again(rival_s=0.99)], rivals=[RIVAL]
    )  # 1% faster here, 2% slower in the race: slower overall
    assert both.winner == WIN and both.selected is None
    assert both.rechecked == {RIVAL: (1.02, 0.99)}
    assert both.vs[FULL].processes == 2 and len(both.vs_processes) == 2
    line = both.recheck_line()
    assert line is not None and line.startswith("raced again in fresh processes, vs FF..")
    assert "F.F. -0.5% in 2 processes (-2.0%, +1.0%)" in line and line.endswith("FF.. stays the winner")
    # Not a rival (race.rivals: 0): the processes race it for nothing.
    assert first.estimated_again([_again(rival_s=0.5)]).rechecked == {}
    assert RaceResult.from_dict(both.to_dict()) == both


def test_a_rival_faster_across_processes_wins_and_its_figures_come_from_fresh_processes_only() -> None:
    """The race's own rounds chose the selection's winner; a rival that wins over it across processes
    gets no figure from them (they were a selection), only from the processes after."""
    first = _first_race((1.02,) * 6)
    both = first.estimated_again([_again(rival_s=0.95)], rivals=[RIVAL])
    assert both.winner == RIVAL and both.selected == WIN
    assert both.rechecked[RIVAL] == (1.02, 0.95)
    # Its figure against full is from the fresh process's rounds only: 1.3 / 0.95 there.
    assert len(both.vs_processes) == 1 and both.vs[FULL].ratio == 1.3 / 0.95 and both.vs[FULL].processes == 1
    line = both.recheck_line()
    assert line is not None and line.endswith("F.F. is faster across them and wins over FF..")
    # One more process measures the new winner against the references: the figure spans both.
    third = _again(rival_s=1.0, full_s=1.2, winner=RIVAL)
    done = both.refigured([third], references=[FULL], confidence=0.95)
    assert done.vs[FULL].processes == 2 and done.vs[FULL].low == 1.2 and done.vs[FULL].high == 1.3 / 0.95
    assert done.headlines()[0].startswith("F.F. vs baseline full FFFF: ")
    assert RaceResult.from_dict(done.to_dict()) == done


def test_a_rival_is_disputed_while_its_processes_disagree_and_a_dispute_adds_no_figure() -> None:
    first = _first_race((1.02,) * 6)
    both = first.estimated_again([_again(rival_s=0.95)], rivals=[RIVAL])
    assert both.disputed() == [RIVAL]
    assert first.estimated_again([_again(rival_s=1.01)], rivals=[RIVAL]).disputed() == []
    # A dispute's process races the two alone: no figure, so the figures keep their two processes.
    alone = RaceResult(
        outcome="ok",
        entrants={
            k: RaceEntrant(key=k, short=k, labels=(), estimate_s=(t,) * 8) for k, t in ((WIN, 1.0), (RIVAL, 1.1))
        },
        winner=WIN,
        estimate_rounds=8,
    )
    three = first.estimated_again([_again(rival_s=0.99), alone], rivals=[RIVAL])
    assert three.winner == WIN and three.rechecked[RIVAL] == (1.02, 0.99, 1.1)
    assert len(three.vs_processes) == 2 and three.vs[FULL].processes == 2
    # That third process sided clearly with the race's: settled. One near parity settles nothing.
    assert three.disputed() == []
    level = dataclasses.replace(
        alone, entrants={**alone.entrants, RIVAL: dataclasses.replace(alone.entrants[RIVAL], estimate_s=(1.0,) * 8)}
    )
    assert first.estimated_again([_again(rival_s=0.95), level], rivals=[RIVAL]).disputed() == [RIVAL]


def test_a_rival_measured_in_one_process_only_decides_nothing() -> None:
    """Fewer than 2 rounds beside the winner in the race's own process: one process's figure, and the
    selection's winner stands (one process is what the recheck is there to outvote)."""
    first = _first_race((1.02, None, None, None, None, None))
    both = first.estimated_again([_again(rival_s=0.5)], rivals=[RIVAL])
    assert both.winner == WIN and both.selected is None and both.rechecked == {}
    assert both.recheck_line() is None


def test_the_rivals_are_the_unresolved_closest_first_and_never_one_out() -> None:
    race = _first_race((1.02,) * 6)
    other = RaceEntrant(key="o", short="Fs..", labels=(), select_s=(1.01,) * 6)
    gone = RaceEntrant(key="x", short="F..F", labels=(), out="peaked over the limit")
    race = dataclasses.replace(
        race,
        entrants={**race.entrants, "o": other, "x": gone},
        unresolved=(RIVAL, "o", "x"),
        behind={**race.behind, "o": Interval(ratio=1.01, low=0.9, high=1.1, rounds=6, confidence=0.97)},
    )
    assert race.rivals(2) == ["o", RIVAL]
    assert race.rivals(1) == ["o"] and race.rivals(0) == []
