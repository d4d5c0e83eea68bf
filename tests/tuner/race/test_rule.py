"""`lightning_recompute.race.rule` and `tuner._decision`: who leads, who is beaten, who is tied, and who races."""

from __future__ import annotations

import dataclasses
import random

import pytest

from lightning_recompute.policy import RecomputePolicy
from lightning_recompute.race.rule import recompute_strength, stand, tie_break, verdict
from tuner._decision import choose_field
from tuner._search import TrialRecord

NAMES = ("blocks.0", "blocks.1", "blocks.2")


def _rounds(times: dict[str, float], n: int = 10, noise: float = 0.02, seed: int = 0) -> list[dict[str, float]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        load = rng.uniform(1.0, 1.8)  # the round's moment: every entrant alike
        out.append({k: t * load * rng.uniform(1 - noise, 1 + noise) for k, t in times.items()})
    return out


def test_the_fastest_leads_and_a_slower_one_is_beaten() -> None:
    s = stand(_rounds({"a": 1.0, "b": 1.12, "c": 1.3}), ["a", "b", "c"], confidence=0.95)
    assert s.leader == "a" and sorted(s.beaten()) == ["b", "c"] and s.tied() == []
    assert s.behind["b"].low > 1.0 and s.behind["c"].ratio == pytest.approx(1.3, rel=0.03)


def test_entrants_seen_within_the_tie_margin_are_tied() -> None:
    s = stand(_rounds({"a": 1.0, "b": 1.0, "c": 1.25}, noise=0.01), ["a", "b", "c"], confidence=0.95)
    assert {s.leader, *s.tied()} == {"a", "b"} and s.beaten() == ["c"]
    assert s.behind[s.tied()[0]].high <= 1.0 + s.tie_margin


def test_equal_medians_in_wide_intervals_are_no_tie_the_leader_wins() -> None:
    """A race cut short under heavy noise: b's median is within the margin, but its interval reaches far
    behind the leader, so the race has not seen the two train equally fast; the tie-break (which would
    take b, the most headroom) does not decide, the leader's median does."""
    rounds = _rounds({"a": 1.0, "b": 1.01}, n=8, noise=0.08, seed=3)
    leader = stand(rounds, ["a", "b"], confidence=0.95).leader
    other = next(k for k in ("a", "b") if k != leader)
    peaks, shorts = {leader: 20, other: 10}, {leader: "F..", other: "FF."}  # the tie-break would take `other`
    standing, tied, winner = verdict(rounds, ["a", "b"], peaks, shorts, confidence=0.95)
    assert standing is not None and standing.beaten() == []
    iv = standing.behind[other]
    assert iv.ratio <= 1.0 + standing.tie_margin < iv.high  # close on the median, not in the interval
    assert standing.unresolved() == [other] and tied == [leader] and winner == leader


def test_an_entrant_far_behind_that_the_race_could_not_separate_loses_to_the_leader_not_the_tie_break() -> None:
    # Eight rounds on a noisy machine: FFF is 1.4x slower in seven, and faster in one spell of load.
    rounds = [{"none": 1.0, "full": 1.4} for _ in range(7)] + [{"none": 2.0, "full": 1.5}]
    peaks, shorts = {"none": 20, "full": 10}, {"none": "...", "full": "FFF"}
    standing, tied, winner = verdict(rounds, ["none", "full"], peaks, shorts, confidence=0.95)
    assert standing is not None and standing.beaten() == [] and standing.behind["full"].low < 1.0
    assert standing.unresolved() == ["full"] and tied == ["none"] and winner == "none"
    # Within the margin the same interval is a tie, and the tie goes to the most headroom.
    close = [{"none": 1.0, "full": 1.02} for _ in range(7)] + [{"none": 2.0, "full": 1.5}]
    _, tied, winner = verdict(close, ["none", "full"], peaks, shorts, confidence=0.95)
    assert tied == ["none", "full"] and winner == "full"
    _, tied, winner = verdict(close, ["none", "full"], peaks, shorts, confidence=0.95, tie_margin=0.01)
    assert tied == ["none"] and winner == "none"


def test_a_few_rounds_within_the_margin_are_no_tie() -> None:
    """Three rounds (a race stopped on race.time_s) cannot reach 95%: within 3% in each is no tie yet."""
    rounds = [{"a": 1.0, "b": 1.01}, {"a": 1.0, "b": 1.02}, {"a": 1.0, "b": 0.995}]
    standing, tied, winner = verdict(rounds, ["a", "b"], {"a": 20, "b": 10}, {"a": "F..", "b": "FF."}, confidence=0.95)
    assert standing is not None and standing.behind["b"].high <= 1.0 + standing.tie_margin
    assert standing.behind["b"].confidence < 0.95 and standing.tied() == [] and standing.unresolved() == ["b"]
    assert tied == ["a"] and winner == "a"
    # Six such rounds reach it (1 - 2/64 = 0.969): then the tie, and the headroom, decide.
    _, tied, winner = verdict(rounds * 2, ["a", "b"], {"a": 20, "b": 10}, {"a": "F..", "b": "FF."}, confidence=0.95)
    assert tied == ["a", "b"] and winner == "b"


def test_a_round_an_entrant_missed_is_left_out_of_its_comparison() -> None:
    rounds = _rounds({"a": 1.0, "b": 1.2})
    rounds[3].pop("b")
    s = stand(rounds, ["a", "b"], confidence=0.95)
    assert s.behind["b"].rounds == len(rounds) - 1


def test_a_tie_goes_to_the_most_headroom_then_the_least_recomputation() -> None:
    shorts = {"a": "FFF", "b": "FF.", "c": "ss."}
    assert tie_break(["a", "b", "c"], {"a": 10, "b": 20, "c": 20}, shorts) == "a"
    assert tie_break(["a", "b", "c"], {"a": 30, "b": 20, "c": 20}, shorts) == "c"  # ss. recomputes less than FF.
    assert tie_break(["b", "a"], {"a": 20, "b": 20}, {"a": "F..", "b": "F.."}) == "b"  # then the leader
    assert recompute_strength("F.s") == (1, 5)


def test_verdict_with_one_entrant_or_none() -> None:
    assert verdict([], ["a"], {}, {}, confidence=0.95) == (None, ["a"], "a")
    assert verdict([], [], {}, {}, confidence=0.95) == (None, [], None)


def _record(
    n: int,
    policy: RecomputePolicy,
    thr: float,
    *,
    label: str | None = None,
    mb: int | None = None,
    feasible: bool = True,
    predicted: float | None = None,
) -> TrialRecord:
    return TrialRecord(
        number=n,
        state="COMPLETE",
        outcome="ok",
        policy=policy,
        fingerprint=policy.fingerprint(),
        short=policy.short(NAMES),
        micro_batch=mb,
        label=label,
        throughput=thr,
        step_time_s=1 / thr,
        predicted_step_time_s=predicted,
        feasible=feasible,
        peak_bytes=1,
    )


FULL = RecomputePolicy.uniform("full")
EVERY = RecomputePolicy.from_modes({"blocks.0": "full", "blocks.2": "full"})
ONE = RecomputePolicy.first_n(NAMES, 1, "full")
TWO = RecomputePolicy.first_n(NAMES, 2, "full")
SEL = RecomputePolicy.uniform("selective")
COMPILED = dataclasses.replace(RecomputePolicy.first_n(NAMES, 1, "full"), compile=True)


def test_the_field_is_the_leaders_the_planners_pick_the_baselines_and_the_good_policy() -> None:
    from tuner._tracking import GoodPolicy

    records = [
        _record(0, FULL, 100.0, label="baseline:full"),
        _record(1, EVERY, 120.0, label="baseline:every_2nd_full"),
        _record(2, TWO, 130.0, label="planner:budget"),
        _record(3, ONE, 150.0),
        _record(4, SEL, 160.0, feasible=False),  # over budget: never races
        _record(5, COMPILED, 170.0),  # compiled: left out, said so
        _record(6, SEL, 140.0, mb=4),  # another micro-batch,
    ]
    good = GoodPolicy("run-g", EVERY, EVERY.fingerprint(), throughput=1.0, peak_bytes=1, promoted_at=None)
    f = choose_field(records, records[3], good, leaders=2, budget_bytes=10)
    got = {p.short(NAMES): labels for p, labels in f.entrants}
    assert got == {
        "F..": ["trial 3"],
        "FF.": ["trial 2", "planner"],
        "F.F": ["baseline every_2nd_full", "good"],
        "FFF": ["baseline full"],
    }
    assert [p.short(NAMES) for p in f.references] == ["F.F", "FFF"]
    assert f.skipped is None and any("1 compiled trial(s) not raced" in n for n in f.notes)


def _modes(short: str) -> RecomputePolicy:
    glyph = {"F": "full", "s": "selective", ".": "none"}
    return RecomputePolicy.from_modes({n: glyph[g] for n, g in zip(NAMES, short, strict=True)})


def test_the_planners_top_predictions_race_even_when_their_single_trials_ranked_low() -> None:
    """``FF.``'s one trial came in slow (load), behind two leaders; the planner predicts it, ``F.F`` (the same
    cost) and ``.FF`` within 5% of its fastest, so the faster trials of those race; slower predictions,
    policies that do not fit and other micro-batches never enter this way."""
    records = [
        _record(0, _modes("FFF"), 100.0, label="baseline:full", predicted=0.30),
        _record(1, _modes("sss"), 160.0, predicted=0.26),
        _record(2, _modes("ss."), 150.0, predicted=0.25),
        _record(3, _modes("F.F"), 110.0, predicted=0.2005),
        _record(4, _modes("FF."), 120.0, predicted=0.2),
        _record(5, _modes(".FF"), 105.0, predicted=0.209),  # within 5%, but the slowest trial of the three
        _record(6, _modes("F.s"), 140.0, predicted=0.22),  # 10% behind the fastest prediction: not the planner's top
        _record(7, _modes("..."), 200.0, predicted=0.1, feasible=False),  # does not fit: never races
        _record(8, _modes("..F"), 130.0, predicted=0.15, mb=4),  # another micro-batch: never races
        _record(9, _modes("s.s"), 101.0, predicted=None),  # no prediction
        _record(10, _modes(".s."), 102.0, predicted=float("nan")),  # an unusable one
    ]
    f = choose_field(records, records[1], None, leaders=2, predicted=2, budget_bytes=None)
    got = {p.short(NAMES): labels for p, labels in f.entrants}
    assert got == {
        "sss": ["trial 1"],
        "ss.": ["trial 2"],
        "FFF": ["baseline full"],
        "FF.": ["planner prediction"],
        "F.F": ["planner prediction"],
    }
    one = choose_field(records, records[1], None, leaders=2, predicted=1, budget_bytes=None)
    assert {p.short(NAMES) for p, labels in one.entrants if "planner prediction" in labels} == {"FF."}
    # Predictions already in the field (a leader, the planner's pick) are no extra; the span's next one is.
    records[3] = dataclasses.replace(records[3], label="planner:budget")
    lead = choose_field(records, records[1], None, leaders=3, predicted=2, budget_bytes=None)
    assert {p.short(NAMES): labels for p, labels in lead.entrants if p.short(NAMES) in {"FF.", "F.F", ".FF"}} == {
        "F.F": ["planner"],
        "FF.": ["planner prediction"],
        ".FF": ["planner prediction"],
    }
    assert "F.s" in {p.short(NAMES) for p, _ in lead.entrants}  # as the third leader, not as a prediction
    none = choose_field(records, records[1], None, leaders=2, predicted=0, budget_bytes=None)
    assert [labels for _, labels in none.entrants] == [["trial 1"], ["trial 2"], ["planner"], ["baseline full"]]


def test_no_race_for_a_compiled_best_or_a_lone_candidate() -> None:
    compiled = _record(5, COMPILED, 170.0)
    assert "compiles its layers" in (
        choose_field([compiled], compiled, None, leaders=4, budget_bytes=None).skipped or ""
    )
    lone = _record(3, ONE, 150.0)
    assert (
        choose_field([lone], lone, None, leaders=4, budget_bytes=None).skipped
        == "only one candidate fits: nothing to race"
    )


def test_the_tie_line_says_why_the_winner_was_chosen() -> None:
    from lightning_recompute.race import RaceEntrant, RaceResult

    def result(winner: str, peaks: dict[str, int]) -> RaceResult:
        shorts = {"L": "FFs..", "W": "FFF..", "X": "F.F.F"}
        entrants = {k: RaceEntrant(key=k, short=shorts[k], labels=(k,), peak_bytes=peaks[k]) for k in shorts}
        return RaceResult(outcome="ok", entrants=entrants, winner=winner, leader="L", tied=("L", "W", "X"))

    assert result("L", {"L": 4, "W": 4, "X": 5}).tie_line().endswith("chose FFs.. (the leader)")  # type: ignore[union-attr]
    assert result("W", {"L": 5, "W": 3, "X": 4}).tie_line().endswith("(the most memory headroom)")  # type: ignore[union-attr]
    line = result("W", {"L": 5, "W": 4, "X": 4}).tie_line()
    assert line is not None and line.endswith("(the most memory headroom, then the race's order)")


def test_the_unresolved_line_names_who_the_leader_beat_on_its_median_alone() -> None:
    from lightning_recompute.race import RaceEntrant, RaceResult
    from lightning_recompute.race.stats import Interval

    entrants = {k: RaceEntrant(key=k, short=s, labels=(k,)) for k, s in {"L": "...", "F": "FFF"}.items()}
    behind = {"F": Interval(ratio=1.6, low=0.9, high=2.0, rounds=8, confidence=0.99)}
    r = RaceResult(
        outcome="ok", entrants=entrants, winner="L", leader="L", tied=("L",), behind=behind, unresolved=("F",)
    )
    assert r.unresolved_line() == (
        "not separated from ... with confidence, nor seen within the tie margin of it: FFF -37.5% (-50.0..+11.1%); "
        "... leads on its median"
    )
    assert RaceResult.from_dict(r.to_dict()) == r and r.tie_line() is None
