"""The tuning session: flow, decisions, skips, interrupts and resume, with a deterministic trial runner.

Trials here are computed, not run (a fake `run_trial` with exact memory and speed per mode), so
the session's bookkeeping can be checked exactly and quickly; Optuna and MLflow are real (temp
stores). `test_cli.py` runs the same flow with real trial subprocesses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from typing import cast

import pytest
from optuna.trial import TrialState

from lightning_recompute.planner import Planner, Prediction
from lightning_recompute.policy import RecomputePolicy
from tests.helpers import RACE_PLAN_ENV
from tests.tuner.fakes import MIB, TRIAL_WALL_S, ExactTrials, fake_peak, fake_throughput, make_recipe, runs, study_of
from tests.tuner.fakes import SESSION_LAYERS as LAYERS
from tuner import session
from tuner._search.planner_seeds import PlannerSeeds
from tuner._trials import TrialResult
from tuner.exits import EXIT_INFEASIBLE, EXIT_INTERRUPTED, EXIT_OK
from tuner.recipe import from_dict
from tuner.summary import TrialEvent


def test_a_session_promotes_the_fastest_feasible_policy_and_records_every_trial(tmp_path, tracking_uri, fakes):
    recipe = make_recipe(tmp_path, tracking_uri, n_trials=6)
    events: list[TrialEvent] = []
    summary = session.tune(recipe, use_planner=False, on_trial=events.append)
    assert summary.best is not None

    assert summary.status == "promoted" and summary.exit_code == EXIT_OK
    measured = [r for r in summary.records if r.ran]
    assert len(measured) == 6
    limit = int(12 * MIB * 0.95)
    assert summary.budget_bytes == limit
    feasible = [r for r in measured if fake_peak(r.policy) <= limit]
    assert summary.best.throughput == max(fake_throughput(r.policy) for r in feasible)
    assert RecomputePolicy.load(recipe.output) == summary.best.policy
    # Baselines: "none" measured over budget (14 MiB > 11.4 MiB), the others within it.
    assert summary.baselines["none"].outcome == "over_budget" and not summary.baselines["none"].feasible
    # "vs" figures come from the race only: against full (raced as a reference), not against "none",
    # which does not fit and so never raced, whatever its single trial measured.
    assert summary.race is not None and summary.race.ok
    assert summary.race.winner == summary.best.fingerprint
    # One race, in one process: its own rounds decide and give the figures.
    assert summary.best.policy is not None and len(fakes.races) == 1
    (plan,) = fakes.plans
    # The race's rounds may take race.share of what the search's trials took, but never less than
    # race.min_s (these trials took 12 s; a quarter of it would be 3 s), and the session says which.
    assert plan.share is not None and plan.share * TRIAL_WALL_S * len(measured) < plan.min_s
    assert plan.total_s == plan.min_s
    said = (
        "race: at most 30 s of rounds (the race's floor of 30 s; race.share's 25% of the search's 12 s of trials "
        "would be 3 s)"
    )
    assert said in summary.notes
    assert summary.gains["full"] == pytest.approx(summary.best.throughput / 700.0 - 1.0)
    assert summary.gains["none"] is None
    full = summary.vs_figures()["full"]
    assert full["low"] <= full["gain"] <= full["high"] and "interleaved, 6 rounds)" in full["text"]
    assert f"({full['confidence']:.0%} CI " in full["text"]  # the JSON's level is the one its text states
    # One live event per trial told, in order, with the best so far.
    assert [e.record.number for e in events] == [r.number for r in summary.records]
    assert events[-1].best is not None and events[-1].best.number == summary.best.number

    # MLflow holds one trial run per Optuna trial, its outcome, params and metrics; the session ended.
    trial_runs = {int(r.data.params["trial_number"]): r for r in runs(recipe, "trial")}
    assert set(trial_runs) == {r.number for r in summary.records}
    best_run = trial_runs[summary.best.number]
    assert best_run.data.tags["recompute.outcome"] == "ok"
    assert best_run.data.params["policy_fingerprint"] == summary.best.fingerprint
    assert best_run.data.params["layer.blocks.0"] == summary.best.policy.mode_for("blocks.0").value
    assert best_run.data.metrics["measured_throughput"] == summary.best.throughput
    (sess,) = runs(recipe, "session")
    assert sess.info.status == "FINISHED"
    assert "search space grouped" in sess.data.tags["recompute.session_notes"]
    assert sess.data.tags["recompute.race_winner"] == summary.best.fingerprint
    assert sess.data.metrics["race_vs_baseline_full_gain"] == pytest.approx(summary.gains["full"])
    decisions = [r.data.tags["recompute.decision"] for r in runs(recipe, "decision")]
    assert decisions == ["promote"]
    assert not [r for r in runs(recipe) if r.info.status == "RUNNING"]


def test_a_second_session_on_a_finished_study_keeps_the_promoted_policy(tmp_path, tracking_uri, fakes):
    recipe = make_recipe(tmp_path, tracking_uri, n_trials=4)
    first = session.tune(recipe, use_planner=False)
    calls = len(fakes.calls)
    again = session.tune(recipe, use_planner=False)
    assert again.status == "current" and again.exit_code == EXIT_OK
    assert again.trials_this_session == 0 and len(fakes.calls) == calls  # nothing re-measured
    assert again.best is not None and first.best is not None
    assert again.best.number == first.best.number


def test_nothing_within_budget_exits_1_and_writes_no_policy(tmp_path, tracking_uri, fakes):
    recipe = make_recipe(tmp_path, tracking_uri, n_trials=3, budget="4MiB")
    summary = session.tune(recipe, use_planner=False)
    assert summary.status == "infeasible" and summary.exit_code == EXIT_INFEASIBLE
    assert summary.best is None and not recipe.output.exists()
    assert "fits the budget limit" in summary.reasons[0]


def test_search_only_reports_the_best_without_the_gate(tmp_path, tracking_uri, fakes):
    recipe = make_recipe(tmp_path, tracking_uri, n_trials=3)
    summary = session.tune(recipe, use_planner=False, search_only=True)
    assert summary.status == "searched" and summary.exit_code == 0 and summary.best is not None
    assert len(fakes.calls) == 3  # trials only: no confirmation run
    assert not recipe.output.exists() and not runs(recipe, "decision")


def test_the_text_report_shows_the_top_ten_and_the_baselines_and_counts_the_rest(tmp_path, tracking_uri, fakes):
    from tuner import cli

    recipe = make_recipe(tmp_path, tracking_uri, n_trials=14)
    summary = session.tune(recipe, use_planner=False, search_only=True)
    ranked = summary.ranked
    assert len(ranked) == 14
    report = cli._details(summary)
    rows = [line for line in report.splitlines() if line[:4].strip().isdigit()]
    baselines = {r.number for r in summary.baselines.values()}
    shown = [r for i, r in enumerate(ranked) if i < 10 or r.number in baselines]
    assert [int(line.split()[0]) for line in rows] == [ranked.index(r) + 1 for r in shown]
    assert f"... {14 - len(shown)} more (every trial: `--format json`, or trials.csv in MLflow)" in report


class FakePlanner:
    """Predicts twice the real peak: 'none' everywhere (14 MiB) lands far over the 11.4 MiB limit."""

    def predict(self, policy, micro_batch=None):
        return Prediction(
            peak_bytes=2 * fake_peak(policy),
            step_time_s=1.0 / fake_throughput(policy),
            micro_batch=micro_batch or 1,
            peak_at="fake",
            base_bytes=0,
            layers=(),
            estimated=True,
        )


def test_a_candidate_predicted_far_over_budget_is_skipped_and_logged(tmp_path, tracking_uri, fakes, monkeypatch):
    # Only `predict` of the planner is called once the study is seeded.
    fake = cast(Planner, FakePlanner())
    monkeypatch.setattr(session, "plan_seeds", lambda *a, **k: PlannerSeeds(planner=fake))
    recipe = make_recipe(tmp_path, tracking_uri, n_trials=3)
    summary = session.tune(recipe, search_only=True)
    none = summary.baselines["none"]
    assert none.outcome == "skipped" and "more than 1.25x the budget limit" in (none.reason or "")
    (sess,) = runs(recipe, "session")
    assert "status searched" in sess.data.tags["recompute.session_notes"]
    assert "......"[:3] not in fakes.calls  # never run
    assert sum(1 for r in summary.records if r.ran) == 3  # skips do not count as trials
    study = study_of(recipe, summary)
    assert study.study.trials[none.number].state == TrialState.PRUNED
    run = next(r for r in runs(recipe, "trial") if r.data.params["trial_number"] == str(none.number))
    assert run.data.tags["recompute.outcome"] == "skipped"
    assert run.data.metrics["predicted_peak_bytes"] == 2 * fake_peak(none.policy)


def test_first_ctrl_c_finishes_the_trial_then_stops_and_a_rerun_resumes(tmp_path, tracking_uri, fakes):
    recipe = make_recipe(tmp_path, tracking_uri, n_trials=4)
    # Ctrl-C while the second trial runs: it must still be measured and recorded.
    fakes.on_call = lambda n, policy: os.kill(os.getpid(), signal.SIGINT) if n == 2 else None
    summary = session.tune(recipe, use_planner=False)
    assert summary.status == "interrupted" and summary.exit_code == EXIT_INTERRUPTED
    assert [r.outcome for r in summary.records] == ["over_budget", "ok"]
    study = study_of(recipe, summary)
    assert not study.running()
    assert [r.info.status for r in runs(recipe, "session")] == ["KILLED"]
    assert not [r for r in runs(recipe) if r.info.status == "RUNNING"]
    waiting = len(study.waiting())

    fakes.on_call = None
    resumed = session.tune(recipe, use_planner=False, search_only=True)
    assert resumed.status == "searched" and resumed.trials_this_session == 2
    records = resumed.records
    assert sum(1 for r in records if r.ran) == 4
    seeds = [r.label for r in records if r.label]
    assert len(seeds) == len(set(seeds)) == 4  # every baseline once: nothing re-seeded
    assert len(study_of(recipe, resumed).waiting()) == waiting - 2
    assert [r.info.status for r in runs(recipe, "session")] == ["FINISHED"]  # the session run resumed


def test_second_ctrl_c_kills_the_trial_and_its_seed_runs_on_resume(tmp_path, tracking_uri, fakes):
    recipe = make_recipe(tmp_path, tracking_uri, n_trials=4)  # the re-queued seed comes after the other three

    def press_twice(n, policy):
        if n == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # the handler raises here, as it would in run_trial's wait

    fakes.on_call = press_twice
    summary = session.tune(recipe, use_planner=False)
    assert summary.exit_code == EXIT_INTERRUPTED
    assert [r.outcome for r in summary.records] == ["over_budget", "interrupted"]
    killed = summary.records[1]
    assert killed.label == "baseline:full" and killed.state == "FAIL"
    assert not study_of(recipe, summary).running()
    assert not [r for r in runs(recipe) if r.info.status == "RUNNING"]
    assert str(killed.number) not in {r.data.params.get("trial_number") for r in runs(recipe, "trial")}

    fakes.on_call = None
    resumed = session.tune(recipe, use_planner=False, search_only=True)
    full = [r for r in resumed.records if r.label == "baseline:full"]
    assert [r.outcome for r in full] == ["interrupted", "ok"]  # re-queued, then measured once
    assert resumed.baselines["full"].outcome == "ok"
    assert sum(1 for r in resumed.records if r.ran) == 4


def test_failed_trials_are_recorded_and_the_session_goes_on(tmp_path, tracking_uri, monkeypatch):
    fakes = ExactTrials()

    def flaky(recipe, policy, **kwargs):
        if policy.short(LAYERS) == "FFF":
            fakes.calls.append("FFF")
            return TrialResult(outcome="error", error="RuntimeError: boom", device="cpu")
        return fakes.run_trial(recipe, policy, **kwargs)

    monkeypatch.setattr("tuner._trials.run_trial", flaky)
    recipe = make_recipe(tmp_path, tracking_uri, n_trials=3)
    summary = session.tune(recipe, use_planner=False, search_only=True)
    full = summary.baselines["full"]
    assert full.outcome == "error" and full.state == "FAIL" and full.reason == "RuntimeError: boom"
    assert summary.gains["full"] is None
    run = next(r for r in runs(recipe, "trial") if r.data.params["trial_number"] == str(full.number))
    assert run.data.tags["recompute.outcome"] == "error"


def test_the_search_stops_when_the_space_is_exhausted(tmp_path, tracking_uri, fakes):
    # Two alike layers, modes none/full: four distinct policies however many trials are asked for.
    recipe = from_dict(
        {
            "model": {"init_args": {"n_layer": 2, "n_embd": 32, "seq_len": 32, "n_head": 2}},
            "budget": "64MiB",
            "search": {"n_trials": 6, "modes": ["none", "full"]},
            "tracking": {"uri": tracking_uri, "experiment": f"exp-{tmp_path.name}"},
            "study": {"storage": "optuna.log"},
        },
        source=tmp_path / "recipe.yaml",
    )
    summary = session.tune(recipe, use_planner=False, search_only=True)
    measured = [r for r in summary.records if r.ran]
    assert sorted(r.short for r in measured) == ["..", ".F", "F.", "FF"]
    assert len(fakes.calls) == 4  # duplicates are told, never run
    assert any("search space exhausted" in note for note in summary.notes)
    assert all(r.outcome == "duplicate" for r in summary.records[-session.MAX_UNMEASURED_IN_A_ROW :])


def test_a_data_module_whose_batches_vary_is_said_once_with_the_batch_trials_measure(tmp_path, tracking_uri, fakes):
    fakes.batches = {
        "scanned": 4,
        "exhaustive": True,
        "largest_index": 3,
        "largest_samples": 16,
        "largest_elements": 512,
        "smallest_samples": 1,
        "varies": True,
    }
    summary = session.tune(make_recipe(tmp_path, tracking_uri, n_trials=3), use_planner=False, search_only=True)
    said = [n for n in summary.notes if n.startswith("data: ")]
    assert said == [
        "data: batches vary (1..16 samples over 4 batches, the whole epoch): every measured step uses the largest, "
        "batch 3 (16 samples, 512 tensor elements)"
    ]


def test_the_search_stops_at_its_timeout(tmp_path, tracking_uri, fakes, monkeypatch):
    recipe = make_recipe(tmp_path, tracking_uri, n_trials=5)
    recipe = type(recipe)(**{**recipe.__dict__, "search": type(recipe.search)(n_trials=5, timeout_s=30.0)})
    clock = iter([0.0, 10.0, 20.0, 31.0, 40.0, 50.0])

    class FakeTime:  # the session's clock only; Optuna and MLflow keep the real one
        monotonic = staticmethod(lambda: next(clock))
        sleep = staticmethod(lambda s: None)

    monkeypatch.setattr(session, "time", FakeTime)
    summary = session.tune(recipe, use_planner=False, search_only=True)
    assert len(fakes.calls) == 2  # started at 0 s (start), 10 s and 20 s; at 31 s no new trial
    assert any("search.timeout_s (30 s) reached" in note for note in summary.notes)


def test_a_failing_profile_leaves_a_note_and_the_search_goes_on(tmp_path, tracking_uri, fakes, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the model cannot be profiled here")

    monkeypatch.setattr("tuner._trials.profile_recipe", broken)
    recipe = make_recipe(tmp_path, tracking_uri, n_trials=2)
    summary = session.tune(recipe, search_only=True)
    assert summary.status == "searched" and len(fakes.calls) == 2
    assert any("planner failed (RuntimeError: the model cannot be profiled here)" in n for n in summary.notes)
    study = study_of(recipe, summary)
    assert "the model cannot be profiled here" in study.study.user_attrs["planner_note"]  # joiners see why


# ---------------------------------------------------------------------------------------------- the file and the budget


def damage_file(path, how):
    if how == "rm":
        path.unlink()
    else:
        path.write_text("layers: [not, {a: policy\n", encoding="utf-8")


@pytest.mark.parametrize("how", ["rm", "garbage"])
def test_a_rerun_restores_a_missing_or_corrupt_policy_file_from_mlflow(tmp_path, tracking_uri, fakes, how):
    recipe = make_recipe(tmp_path, tracking_uri, n_trials=4)
    first = session.tune(recipe, use_planner=False)
    assert first.status == "promoted"
    good = RecomputePolicy.load(recipe.output)
    damage_file(recipe.output, how)

    lines: list[str] = []
    again = session.tune(recipe, use_planner=False, on_note=lines.append)
    assert (again.status, again.exit_code) == ("current", EXIT_OK)
    assert RecomputePolicy.load(recipe.output) == good
    restored = [n for n in again.notes if n.startswith("policy file: ")]
    assert len(restored) == 1 and f"restored the good policy {good.fingerprint()}" in restored[0]
    assert again.policy_path == recipe.output
    # Nothing was confirmed (the best is the good policy already), so nothing says it was.
    assert not [line for line in lines if line.startswith("gate: confirming")]


def test_tightening_the_budget_replaces_a_good_policy_that_no_longer_fits(tmp_path, tracking_uri, fakes):
    loose = make_recipe(tmp_path, tracking_uri, n_trials=6)
    first = session.tune(loose, use_planner=False)
    assert first.status == "promoted"
    before = RecomputePolicy.load(loose.output)
    tight = make_recipe(tmp_path, tracking_uri, n_trials=6, budget="7MiB")
    limit = int(7 * MIB * 0.95)
    assert fake_peak(before) > limit  # the test's premise: the good policy does not fit the new limit

    second = session.tune(tight, use_planner=False)
    assert (second.status, second.exit_code) == ("promoted", EXIT_OK), second.reasons
    after = RecomputePolicy.load(tight.output)
    assert second.best is not None and after == second.best.policy
    assert fake_peak(after) <= limit
    assert any("no contender" in r for r in second.reasons), second.reasons


@pytest.mark.parametrize("how", ["rm", "garbage"])
def test_rollback_with_one_promotion_restores_a_missing_or_corrupt_file(tmp_path, tracking_uri, fakes, how, capsys):
    import yaml

    from tuner import cli

    recipe = make_recipe(tmp_path, tracking_uri, n_trials=4)
    (tmp_path / "recipe.yaml").write_text(
        yaml.safe_dump(
            {
                "model": {"init_args": {"n_layer": 3, "n_embd": 32, "seq_len": 32, "n_head": 2}},
                "budget": {"value": "12MiB", "margin": 0.05},
                "search": {"n_trials": 4, "seed": 0},
                "trial": {"warmup_steps": 1, "measure_steps": 2},
                "tracking": {"uri": tracking_uri, "experiment": f"exp-{tmp_path.name}"},
                "study": {"storage": "optuna.log"},
            }
        ),
        encoding="utf-8",
    )
    assert session.tune(recipe, use_planner=False).status == "promoted"
    good = RecomputePolicy.load(recipe.output)
    damage_file(recipe.output, how)

    assert cli.main(["rollback", str(tmp_path / "recipe.yaml")]) == EXIT_OK
    out = capsys.readouterr().out
    assert RecomputePolicy.load(recipe.output) == good
    assert "policy file: " in out and "restored the good policy" in out
    assert "nothing earlier to roll back to" in out
    # With the file intact, a rollback with nothing earlier is still an error.
    assert cli.main(["rollback", str(tmp_path / "recipe.yaml")]) == EXIT_INFEASIBLE


@pytest.mark.parametrize(
    ("micro_batch", "data_batch", "says"),
    [
        (4, 8, "set batch_size=4, accumulate_grad_batches=2 in the training job to keep the global batch of 8"),
        (3, 8, "set batch_size=2, accumulate_grad_batches=4 in the training job to keep the global batch of 8"),
        (8, 8, "no change: the policy was tuned at the data's batch size of 8"),
        (16, 8, "set batch_size=16 in the training job"),
        (4, None, "train at batch_size=4 per device"),
    ],
)
def test_the_training_change_says_what_to_set(micro_batch, data_batch, says):
    from lightning_recompute import TunedFor
    from tuner.summary import training_change

    assert training_change(TunedFor(micro_batch=micro_batch, data_batch_size=data_batch)).startswith(says)
    assert training_change(None) is None and training_change(TunedFor(device="cpu")) is None


def test_sighup_stops_the_session_like_sigterm(tmp_path, tracking_uri, fakes):
    # A closed terminal (SIGHUP) used to end the process with the trial and session runs RUNNING.
    recipe = make_recipe(tmp_path, tracking_uri, n_trials=4)

    def unhandled(signum, frame):
        raise AssertionError("SIGHUP reached the test's handler: the session did not handle it")

    fakes.on_call = lambda n, policy: os.kill(os.getpid(), signal.SIGHUP) if n == 2 else None
    previous = signal.signal(signal.SIGHUP, unhandled)  # without the fix, SIGHUP would end pytest itself
    try:
        summary = session.tune(recipe, use_planner=False)
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert summary.status == "interrupted" and summary.exit_code == EXIT_INTERRUPTED
    assert [r.outcome for r in summary.records] == ["over_budget", "interrupted"]  # killed at once, as SIGTERM
    assert not study_of(recipe, summary).running()
    assert [r.info.status for r in runs(recipe, "session")] == ["KILLED"]
    assert not [r for r in runs(recipe) if r.info.status == "RUNNING"]


def test_a_race_budget_above_its_floor_is_race_share_of_the_search(tmp_path, tracking_uri, fakes, monkeypatch):
    monkeypatch.setenv(RACE_PLAN_ENV, json.dumps({"min_s": 1}))
    recipe = make_recipe(tmp_path, tracking_uri, n_trials=6)
    summary = session.tune(recipe, use_planner=False)
    measured = [r for r in summary.records if r.ran]
    plan = fakes.plans[0]
    assert plan.share is not None and plan.total_s == pytest.approx(plan.share * TRIAL_WALL_S * len(measured))
    assert plan.total_s > plan.min_s
    assert "race: at most 3 s of rounds (25% of the search's 12 s of trials, race.share)" in summary.notes


def test_the_text_report_accounts_for_every_baseline_and_gives_unraced_ones_no_figure(tmp_path, tracking_uri, fakes):
    """Each baseline gets a "vs" line: the race's figure, why it was not measured, or that it was not raced;
    a baseline that fits but was not raced gets no figure from its single trial."""
    from tuner import cli

    recipe = make_recipe(tmp_path, tracking_uri, n_trials=6)
    summary = session.tune(recipe, use_planner=False)
    assert summary.status == "promoted" and summary.race is not None and summary.race.ok
    report = cli._details(summary).splitlines()
    figures = summary.vs_figures()
    assert summary.best is not None
    (chosen,) = [n for n, r in summary.baselines.items() if r.fingerprint == summary.best.fingerprint]
    entered = summary.race.entrants
    fitting = [n for n, r in summary.baselines.items() if r.ran and r.feasible and n not in figures and n != chosen]
    unraced = [n for n in fitting if summary.baselines[n].fingerprint not in entered]
    selection_only = [n for n in fitting if summary.baselines[n].fingerprint in entered]
    assert selection_only, "the fake session races a baseline as a leader, not as a reference"
    for name, rec in summary.baselines.items():
        (line,) = [x for x in report if x.startswith(f"  vs {name} ")]
        if name == chosen:
            # The winner is a baseline here (as the quickstart's every_2nd_full often is): it says so.
            assert line.endswith("this is the chosen policy, no figure against itself") and "not raced" not in line
        elif name in selection_only:
            # Raced as a leader, not a reference of the estimation (the quickstart's ssssss): where its
            # figure is, and no "vs" figure from the selection that chose the winner.
            assert line.endswith(
                "raced in the selection only ('vs leader' above); no estimation rounds, no 'vs' figure"
            )
            assert "%" not in line
        elif name in unraced:
            rank = summary.ranked.index(rec) + 1
            assert line.endswith(
                f"not raced (its single trial ranked {rank} of {len(summary.ranked)}; no 'vs' figure from one run)"
            )
            assert "%" not in line

    name = selection_only[0]
    rec = summary.baselines[name]

    # The same baseline left out of the race's field: not raced, and no figure from its single trial.
    without = {k: e for k, e in entered.items() if k != rec.fingerprint}
    left_out = dataclasses.replace(summary, race=dataclasses.replace(summary.race, entrants=without))
    (line,) = [x for x in cli._details(left_out).splitlines() if x.startswith(f"  vs {name} ")]
    rank = summary.ranked.index(rec) + 1
    assert line.endswith(
        f"not raced (its single trial ranked {rank} of {len(summary.ranked)}; no 'vs' figure from one run)"
    )
    assert "%" not in line


def test_the_default_report_reads_in_ten_seconds(tmp_path, tracking_uri, fakes):
    """At most 15 lines: what was promoted and where, the glyphs, speed and peak against the limit, each
    baseline once with one figure and its interval at the recipe's confidence ("not significant" beside one
    that spans zero), the gate in one line, where to see more. The tables are behind --verbose."""
    from lightning_recompute.race.stats import Interval
    from tuner import cli

    recipe = make_recipe(tmp_path, tracking_uri, n_trials=6)
    summary = session.tune(recipe, use_planner=False)
    assert summary.status == "promoted" and summary.best is not None and summary.race is not None
    report = cli._report(summary).splitlines()[1:]  # a blank line first, after the progress
    assert len(report) <= 15, "\n".join(report)
    where = cli._micro_batch(summary.best.micro_batch, summary.data_batch_size)
    assert report[0] == f"promoted {summary.best.short} at {where}: written to {recipe.output}"
    assert report[1].startswith("  one glyph per layer (") and "F full" in report[1]
    assert f"of the {cli._bytes(summary.budget_bytes)} limit" in report[2]
    for name in summary.baselines:
        assert len([x for x in report if x.startswith(f"  vs {name} ")]) == 1
    gate = [x for x in report if x.startswith("  gate: ")]
    assert gate == ["  gate: passed " + ", ".join(r.partition(": ")[0] for r in summary.reasons)]
    assert report[-1] == f"  browse: {summary.mlflow_command}"
    assert not any(x.startswith("rank") or "vs leader" in x for x in report)

    # One figure with its interval at the recipe's confidence; "not significant" only when it spans zero.
    full = summary.baselines["full"]
    for low, high, said in ((1.05, 1.30, False), (0.90, 1.30, True)):
        iv = Interval(ratio=1.2, low=low, high=high, rounds=16, confidence=0.99)
        race = dataclasses.replace(summary.race, vs={full.fingerprint: iv})
        other = dataclasses.replace(summary, race=race, best=summary.baselines["none"], confidence=0.9)
        (line,) = [x for x in cli._report(other).splitlines() if x.startswith("  vs full ")]
        assert line.endswith(
            f"{full.short}: +20.0% throughput (90% CI {(low - 1) * 100:+.1f}..{(high - 1) * 100:+.1f}%)"
            + (", not significant" if said else "")
        ), line


def test_the_report_names_the_race_winner_when_it_is_no_trial_of_this_study(tmp_path, tracking_uri, fakes):
    """The good policy of an earlier study (another budget) can win this study's race: the report's head and
    figures are that winner's, not this study's best single trial."""
    from tuner import cli

    recipe = make_recipe(tmp_path, tracking_uri, n_trials=6)
    summary = session.tune(recipe, use_planner=False)
    assert summary.race is not None and summary.best is not None
    other = next(k for k, e in summary.race.entrants.items() if k != summary.best.fingerprint and e.out is None)
    earlier = dataclasses.replace(summary, race=dataclasses.replace(summary.race, winner=other), chosen=False)
    earlier.status = "current"
    lines = cli._report(earlier).splitlines()
    assert lines[1].startswith(f"unchanged: {summary.race.entrants[other].short} at ")
    assert lines[3].startswith(f"  {cli._num(summary.race.throughput(other))} ")
