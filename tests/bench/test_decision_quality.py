"""`bench/decision_quality.py`'s grading: what a session printed against the truth."""

from __future__ import annotations

from bench import decision_quality as dq

FULL, WIN, TIED = "f" * 16, "w" * 16, "t" * 16


def _summary() -> dict:
    return {
        "status": "promoted",
        "best": {"policy_short": "FF.."},
        "vs": {"full": {"gain": 0.207, "low": 0.04, "high": 0.36, "text": "+20.7% (...)"}},
        "race": {
            "entrants": {
                FULL: {"labels": ["baseline full"], "short": "FFFF"},
                WIN: {"labels": ["trial 3"], "short": "FF.."},
                TIED: {"labels": ["trial 5"], "short": "ss.."},
            },
            "leader": TIED,
            "tied": [TIED, WIN],
        },
    }


def test_a_session_is_graded_on_its_printed_interval() -> None:
    row = dq.extract({"summary": _summary()})
    assert row["promoted"] == "FF.." and row["vs_full"] == {"low": 0.04, "high": 0.36}
    truth = {"rel_time": {"FF..": 0.8, "FFFF": 1.0}, "best": "FF..", "pair_rel_time": {"FF..": 0.8}}
    graded = dq.grade(row, truth)  # true gain: 1 / 0.8 - 1 = +25%
    assert graded["regret"] == 1.0 and graded["covered"] is True
    missed = dq.grade(row, {**truth, "pair_rel_time": {"FF..": 0.7}})  # true gain +42.9%: outside
    assert missed["covered"] is False


def test_a_session_says_whether_its_promoted_policy_led_the_race_or_won_a_tie_break() -> None:
    row = dq.extract({"summary": _summary()})
    assert row["race_leader"] == "ss.." and row["race_tied"] == ["ss..", "FF.."]
    assert row["race_field"] == ["FF..", "FFFF", "ss.."]


def test_the_steady_regret_is_over_the_fastest_policy_the_steady_truth_measured_and_is_reported() -> None:
    per_turn = {"FF..": [0.6, 0.82, 1.04], "F.F.": [0.8, 0.836, 0.9], "FFFF": [1.0, 1.0, 1.0]}
    steady = {"rel": {"FF..": 0.82, "F.F.": 0.836, "FFFF": 1.0}, "per_turn": per_turn, "processes": 3, "steps": 30}
    assert dq.grade_steady({"promoted": "F.F."}, steady)["regret_steady"] == 0.836 / 0.82
    assert dq.grade_steady({"promoted": "ss.."}, steady) == {}  # not measured alone: no steady grade
    rows = [
        {"condition": "quiet", "session": i, "race": True, "wall_s": 100.0, "regret": 1.0, "regret_steady": r}
        for i, r in enumerate((1.0, 1.02, 1.0))
    ]
    rows[1]["promoted"] = "F.F."
    truth = {"pair_rel_time": {"FF..": 0.80, "F.F.": 0.82, "FFFF": 1.0}}
    lines = dq.report({"workloads": {"wide4": {"sessions": rows, "steady": steady, "truth": truth}}})
    # One of the three sessions promoted F.F., 0.82 / 0.80 of the pair truth's best.
    assert "pair regret med 1.025 worst 1.025" in lines[2]  # only graded rows count: the one promoted F.F.
    assert "steady regret med 1.000 worst 1.020" in lines[2]
    assert lines[-1].startswith("wide4 steady truth (3 turns")
    assert "FF.. 0.820 (0.600..1.040), F.F. 0.836 (0.800..0.900), FFFF 1.000 (1.000..1.000)" in lines[-1]


def test_the_wall_ratio_pairs_each_raced_session_with_its_baseline_and_names_the_baselines_workers() -> None:
    # The wall target's baseline is the tuner before the race and the fork server: fresh workers.
    rows = [
        {"condition": "quiet", "session": 0, "race": True, "workers": "forked", "wall_s": 90.0, "race_wall_s": 20.0},
        {"condition": "quiet", "session": 0, "race": False, "workers": "fresh", "wall_s": 120.0},
        {"condition": "quiet", "session": 1, "race": True, "workers": "forked", "wall_s": 130.0, "race_wall_s": 24.0},
        {"condition": "quiet", "session": 1, "race": False, "workers": "fresh", "wall_s": 100.0},
    ]
    lines = dq.report({"workloads": {"wide4": {"sessions": rows, "truth": {}}}})
    assert lines[2].split()[:5] == ["wide4", "quiet", "on", "forked", "2"]
    assert lines[3].split()[:5] == ["wide4", "quiet", "off", "fresh", "2"]
    # 90/120 and 130/100, each against its own session's baseline.
    assert lines[-1] == (
        "wide4 quiet: session wall with the race / without (fresh workers): median 1.02 (range 0.75..1.30 over "
        "2 pairs); race itself median 22 s"
    )


def test_a_promotions_regret_is_taken_within_each_process_of_the_pair_truth_with_a_t_interval() -> None:
    # Process effects move every policy together (process 2 is slow for all): within a process the ratio
    # of F.F. over FF.. is 1.01, 1.00, 1.02; the interval is over those three, not over the raw figures.
    per_process = {"FF..": [0.80, 0.90, 0.85], "F.F.": [0.808, 0.90, 0.867], "FFFF": [1.0, 1.0, 1.0]}
    judged = dq.process_regret(per_process, "F.F.")
    assert judged is not None and judged["best"] == "FF.." and judged["processes"] == 3
    assert [round(r, 3) for r in judged["per_process"]] == [1.01, 1.0, 1.02]
    assert round(judged["regret"], 3) == 1.01
    assert judged["low"] < 1.0 < judged["high"] < 1.05  # t(2) = 4.303: three processes cannot rule out a tie
    itself = dq.process_regret(per_process, "FF..")
    assert itself is not None and itself["regret"] == 1.0
    assert dq.process_regret(per_process, "ss..") is None  # not raced in the pair truth
    assert dq.process_regret({"FF..": [0.8], "FFFF": [1.0]}, "FF..") is None  # one process: no interval
    rows = [{"condition": "quiet", "session": 0, "race": True, "wall_s": 9.0, "promoted": "F.F.", "regret": 1.0}]
    truth = {"pair_rel_time": {"FF..": 0.85, "F.F.": 0.858, "FFFF": 1.0}, "pair_per_process": per_process}
    lines = dq.report({"workloads": {"wide4": {"sessions": rows, "truth": truth}}})
    assert lines[-1].startswith("wide4 promoted over the pair truth's best (FF..), across 3 processes")
    assert "F.F. 1.010 (" in lines[-1] and "1.010 1.000 1.020)" in lines[-1]
