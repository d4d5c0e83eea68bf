"""`lightning_recompute.race.schedule.RaceSchedule`: the turns and the decision, fed measurements by hand (no model).

The engine's tests race real models; these pin what several ranks and a job that ends early rely on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from lightning_recompute import RecomputePolicy
from lightning_recompute.race import RacePlan
from lightning_recompute.race.schedule import MIN_ESTIMATE_ROUNDS, RaceSchedule, RoundReport

NAMES = [f"blocks.{i}" for i in range(3)]
FULL, NONE = RecomputePolicy.uniform("full"), RecomputePolicy.uniform("none")
ONE = RecomputePolicy.first_n(NAMES, 1, "full")
ENTRANTS = [(p.fingerprint(), p, p.short(NAMES)) for p in (FULL, ONE, NONE)]
PLAN = RacePlan(steps=1, min_rounds=3, max_rounds=8, time_s=1e9, estimate_rounds=2, warmup_steps=1)
BASE = {FULL.fingerprint(): 1.3, ONE.fingerprint(): 1.1, NONE.fingerprint(): 1.0}


def _drive(schedule: RaceSchedule, times: dict[str, float], peaks: dict[str, int], limit_steps: int = 500) -> list[str]:
    """Run the schedule to its end; the keys of the turns it asked for."""
    ran = []
    for _ in range(limit_steps):
        turn = schedule.next_turn()
        if turn is None:
            return ran
        ran.append(turn.key)
        schedule.record(turn, times[turn.key], peaks[turn.key] if turn.metered else None)
    raise AssertionError("the schedule never ended")


def test_ranks_that_agree_take_the_same_turns_and_decision_whatever_their_own_clocks_say() -> None:
    """Rank 1's times say the opposite of rank 0's; with `agree` taking rank 0's, both race alike."""
    reports: list[RoundReport] = []

    def rank0_agree(report: RoundReport) -> RoundReport:
        reports.append(report)
        return report

    def rank1_agree(report: RoundReport) -> RoundReport:
        return dataclasses.replace(reports[len(reports) - 1], peaks=report.peaks)

    peaks = {k: 1 for k in BASE}
    r0 = RaceSchedule(ENTRANTS, [FULL.fingerprint()], PLAN, agree=rank0_agree)
    r1 = RaceSchedule(ENTRANTS, [FULL.fingerprint()], PLAN, agree=rank1_agree)
    flipped = {k: 1.0 / v for k, v in BASE.items()}
    turns0, turns1 = [], []
    for _ in range(500):  # in lockstep, as the ranks of one job: rank 0 closes each round first
        t0, t1 = r0.next_turn(), r1.next_turn()
        assert (t0 is None) == (t1 is None)
        if t0 is None or t1 is None:
            break
        turns0.append(t0.key)
        turns1.append(t1.key)
        r0.record(t0, BASE[t0.key], peaks[t0.key] if t0.metered else None)
        r1.record(t1, flipped[t1.key], peaks[t1.key] if t1.metered else None)
    assert turns0 == turns1
    assert r0.winner == r1.winner == NONE.fingerprint()


def test_a_peak_over_the_limit_on_any_rank_puts_the_entrant_out_on_every_rank_at_the_rounds_end() -> None:
    def agree(report: RoundReport) -> RoundReport:
        # The other rank measured NONE over the limit.
        return dataclasses.replace(report, peaks={**report.peaks, NONE.fingerprint(): 500})

    schedule = RaceSchedule(ENTRANTS, [], PLAN, budget_bytes=100, agree=agree)
    ran = _drive(schedule, BASE, {k: 10 for k in BASE})
    assert schedule.entrants[NONE.fingerprint()].out is not None
    # One turn (its settling step) in the first round, then never again.
    assert ran.count(NONE.fingerprint()) == 1 + PLAN.steps
    assert schedule.winner == ONE.fingerprint()


def test_one_process_puts_an_entrant_over_the_limit_out_at_once() -> None:
    schedule = RaceSchedule(ENTRANTS, [], PLAN, budget_bytes=100)
    ran = _drive(schedule, BASE, {FULL.fingerprint(): 10, ONE.fingerprint(): 10, NONE.fingerprint(): 500})
    assert ran.count(NONE.fingerprint()) == 1  # its metered settling step only


def test_knock_out_and_finish_end_the_race_on_what_it_has() -> None:
    schedule = RaceSchedule(ENTRANTS, [FULL.fingerprint()], PLAN)
    for _ in range(1 + 3 * 2 * 2):  # warm-up and two rounds
        turn = schedule.next_turn()
        assert turn is not None
        schedule.record(turn, BASE[turn.key], 1 if turn.metered else None)
    schedule.knock_out(NONE.fingerprint(), "out of memory: simulated")
    schedule.finish("the job ended")
    assert schedule.next_turn() is None
    assert schedule.winner == ONE.fingerprint()
    assert schedule.stop_reason == "the job ended after 2 selection rounds"
    assert schedule.stopped == "ended"
    assert schedule.result().entrants[NONE.fingerprint()].out == "out of memory: simulated"


def test_a_race_budget_stops_the_selection_early_enough_to_leave_the_estimation_its_rounds() -> None:
    now = [0.0]
    plan = dataclasses.replace(PLAN, total_s=30.0)
    schedule = RaceSchedule(ENTRANTS, [FULL.fingerprint()], plan, clock=lambda: now[0])
    spent = {"select": 0.0, "estimate": 0.0}
    for _ in range(500):
        turn = schedule.next_turn()
        if turn is None:
            break
        if turn.phase != "warmup":
            now[0] += BASE[turn.key]  # the step takes its time on the race's clock
            spent[turn.phase] += BASE[turn.key]
        schedule.record(turn, BASE[turn.key], 1 if turn.metered else None)
    # A round of three entrants at two steps each is ~7 s, the estimation's two rounds of two ~9 s: a
    assert len(schedule.select_rounds) == 3 and schedule.stop_reason.startswith("race budget of 30 s")
    assert schedule.stopped == "budget"
    assert len(schedule.select_rounds) == 3 and schedule.stop_reason.startswith("race budget of 30 s")
    assert len(schedule.estimate_rounds) == plan.estimate_rounds
    assert spent["select"] + spent["estimate"] <= plan.total_s
    # Without the cap, the same race selects until min_rounds at least.
    free = RaceSchedule(ENTRANTS, [FULL.fingerprint()], PLAN, clock=lambda: 0.0)
    _drive(free, BASE, {k: 1 for k in BASE})
    assert len(free.select_rounds) >= PLAN.min_rounds


def _run_on_clock(plan: RacePlan, speed: Callable[[int], float] = lambda rounds: 1.0) -> RaceSchedule:
    """A race on ``plan`` driven to its end on a fake clock: each step takes its entrant's `BASE` time over
    ``speed(selection rounds done so far)``."""
    now = [0.0]
    schedule = RaceSchedule(ENTRANTS, [FULL.fingerprint()], plan, clock=lambda: now[0])
    while (turn := schedule.next_turn()) is not None:
        took = BASE[turn.key] / speed(len(schedule.select_rounds))
        if turn.phase != "warmup":
            now[0] += took
        schedule.record(turn, took, 1 if turn.metered else None)
    return schedule


def test_a_race_budget_too_small_for_min_rounds_is_overspent_not_cut_below_them() -> None:
    """A short search's budget would pay for one round: the selection still runs `min_rounds` (fewer
    cannot beat anyone at the race's confidence) and the stop reason says the budget was overspent."""
    plan = dataclasses.replace(PLAN, min_rounds=4, total_s=12.0)
    schedule = _run_on_clock(plan)
    assert len(schedule.select_rounds) == 4
    assert schedule.stop_reason == "race budget of 12 s overspent to run the race's fewest rounds, 4"
    assert len(schedule.estimate_rounds) == plan.estimate_rounds


def test_a_round_past_the_floor_that_runs_slow_overspends_the_budget_and_the_stop_reason_says_which() -> None:
    """Past `min_rounds` a round starts only when it fits at the pace so far; one that then runs slow (the
    machine slowed) overspends the budget, and the stop reason blames that round, not the floor."""
    plan = dataclasses.replace(PLAN, min_rounds=2, total_s=30.0)
    schedule = _run_on_clock(plan, lambda rounds: 0.5 if rounds == 2 else 1.0)  # the third round at half speed
    assert len(schedule.select_rounds) == 3
    assert schedule.stop_reason == "race budget of 30 s overspent by the last of 3 rounds, slower than the ones before"
    # The same race at an even pace stops after the same round with the estimation's time left.
    even = _run_on_clock(plan)
    assert len(even.select_rounds) == 3
    assert even.stop_reason == "race budget of 30 s reached after 3 rounds, the estimation's rounds left in it"


def test_under_a_race_budget_the_estimation_keeps_its_minimum_rounds_and_the_selection_the_rest() -> None:
    now = [0.0]
    plan = dataclasses.replace(PLAN, estimate_rounds=16, total_s=60.0)
    schedule = RaceSchedule(ENTRANTS, [FULL.fingerprint()], plan, clock=lambda: now[0])
    spent = 0.0
    for _ in range(500):
        turn = schedule.next_turn()
        if turn is None:
            break
        if turn.phase != "warmup":
            now[0] += BASE[turn.key]
            spent += BASE[turn.key]
        schedule.record(turn, BASE[turn.key], 1 if turn.metered else None)
    # 16 estimation rounds (~70 s) would not fit in 60 s: the estimation gets its minimum, not more than
    # ESTIMATE_SHARE of the budget would pay for, and the selection the rounds that still fit.
    assert len(schedule.estimate_rounds) == MIN_ESTIMATE_ROUNDS
    assert len(schedule.select_rounds) == 3
    assert spent <= plan.total_s
