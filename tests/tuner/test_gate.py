"""tuner._gate + Tracker.promote/reject/rollback/history, with fake trial runners and a real MLflow store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from lightning_recompute.errors import RecomputeError
from lightning_recompute.mlflow_policy import load_good_policy
from lightning_recompute.policy import RecomputePolicy
from tests.tuner.fakes import GATE_LAYERS, FixedTrials, numerics
from tuner import recipe as recipe_mod
from tuner._gate import Candidate, decide, evaluate
from tuner._tracking import Tracker, TrackingError
from tuner._trials import TrialResult
from tuner.recipe._schema import Budget

LAYERS = GATE_LAYERS
A = RecomputePolicy.uniform("full")
B = RecomputePolicy.first_n(LAYERS, 1, "selective")
C = RecomputePolicy.uniform("selective")
LIMIT = 100 * 2**20


def _good_run_id(tracker: Tracker) -> str:
    good = tracker.registry.current_good()
    assert good is not None, "no good policy recorded"
    return good.run_id


@pytest.fixture
def recipe(tmp_path: Path, uri: str) -> recipe_mod.Recipe:
    return recipe_mod.from_dict(
        {
            "name": "gate",
            "budget": "128MiB",
            "model": {"init_args": {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 16, "vocab_size": 64}},
            "trial": {"warmup_steps": 1, "measure_steps": 4, "timeout_s": 30},
            "tracking": {"uri": uri, "experiment": "gate"},
            "output": str(tmp_path / "out" / "policy.yaml"),
        }
    )


def gate(
    tracker: Tracker,
    policy: RecomputePolicy,
    recipe: recipe_mod.Recipe,
    trials: FixedTrials,
    check: Any | None = None,
    **kw: Any,
):
    return decide(
        tracker,
        Candidate(policy, layer_names=LAYERS),
        recipe=recipe,
        budget_bytes=LIMIT,
        run_trial=trials,
        check_numerics=check or numerics(),
        run_race=trials.run_race,
        **kw,
    )


def test_first_promotion_writes_the_file_and_moves_the_record(uri: str, recipe: recipe_mod.Recipe) -> None:
    trials, check = FixedTrials({A: 100.0}), numerics()
    tracker = Tracker(uri, "gate")
    with tracker.sessions.session(recipe, study_name="s"):
        d = decide(
            tracker,
            Candidate(A, micro_batch=8, layer_names=LAYERS),
            recipe=recipe,
            budget_bytes=LIMIT,
            run_trial=trials,
            check_numerics=check,
        )
    assert d.promoted and d.checks == {"confirmation": "passed", "numerics": "passed", "regression": "passed"}
    # The confirmation measures 3x a trial's 4 steps, within the budget limit; no side-by-side without a good one.
    assert [(c["measure_steps"], c["budget_bytes"], c["micro_batch"]) for c in trials.calls] == [(12, LIMIT, 8)]
    assert check.calls == [A]
    assert RecomputePolicy.load(recipe.output) == A

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("gate")
    assert exp is not None and d.confirmation_run_id is not None and d.decision_run_id is not None
    assert exp.tags["recompute.good_run_id"] == d.confirmation_run_id
    good = client.get_run(d.confirmation_run_id)
    assert good.data.tags["recompute.kind"] == "confirmation"
    assert good.data.tags["recompute.good"] == "true"
    assert good.data.params["micro_batch"] == "8"
    assert [m.step for m in client.get_metric_history(good.info.run_id, "step_time_s")] == list(range(12))
    decision = client.get_run(d.decision_run_id)
    assert decision.info.status == "FINISHED"
    assert decision.data.tags["recompute.kind"] == "decision"
    assert decision.data.tags["recompute.decision"] == "promote"
    assert decision.data.tags["recompute.new_good_run_id"] == d.confirmation_run_id
    assert decision.data.tags["recompute.previous_good_run_id"] == ""
    assert "numerics: training unchanged from no recompute" in decision.data.tags["recompute.reason"]
    assert {f.path for f in client.list_artifacts(d.decision_run_id)} == {"policy.yaml", "evidence.json"}

    current = tracker.registry.current_good()
    assert current is not None and current.policy == A and current.micro_batch == 8
    assert current.throughput == 100.0 and current.peak_bytes == 50 * 2**20
    assert load_good_policy("gate", uri) == A  # what RecomputeCallback(policy="mlflow:gate") reads


def test_the_regression_check_races_candidate_and_good_and_a_faster_candidate_replaces_it(
    uri: str, recipe: recipe_mod.Recipe
) -> None:
    tracker = Tracker(uri, "gate")
    gate(tracker, A, recipe, FixedTrials({A: 100.0}))
    trials = FixedTrials({A: 100.0, B: 120.0})
    d = gate(tracker, B, recipe, trials)
    assert d.promoted, d.reasons
    # One confirmation run (3x a trial's steps), then one race of the candidate against the good policy.
    assert [c["measure_steps"] for c in trials.calls] == [12]
    assert trials.races == [[B, A]]
    assert d.evidence["regression"]["winner"] == B.fingerprint()
    assert "the race put the candidate ahead of the current good policy" in d.reason
    assert "+20.0% (95% CI +20.0..+20.0%, interleaved, 6 rounds)" in d.reason  # 6 rounds cover 97%: stated at 95%
    assert RecomputePolicy.load(recipe.output) == B
    assert load_good_policy("gate", uri) == B


@pytest.mark.parametrize(
    ("trials", "check", "failed", "reason"),
    [
        (FixedTrials({A: 100.0, B: 150.0}), numerics(equal=False), "numerics", "numerics differ from no recompute"),
        (FixedTrials({A: 100.0, B: 150.0}, peaks={B: LIMIT + 1}), numerics(), "confirmation", "over the budget limit"),
        (FixedTrials({A: 100.0, B: 150.0}, outcome={B: "oom"}), numerics(), "confirmation", "ended oom: injected oom"),
        (
            FixedTrials({A: 100.0, B: 150.0}, short_by=1),
            numerics(),
            "confirmation",
            "measured 11 steps; the gate needs 12",
        ),
        (FixedTrials({A: 100.0, B: 97.0}), numerics(), "regression", "won the race against the candidate"),
    ],
    ids=["numerics-unequal", "over-budget", "oom", "too-few-steps", "slower"],
)
def test_a_failing_candidate_keeps_the_last_good_policy_and_its_file(
    uri: str, recipe: recipe_mod.Recipe, trials: FixedTrials, check: Any, failed: str, reason: str
) -> None:
    tracker = Tracker(uri, "gate")
    first = gate(tracker, A, recipe, FixedTrials({A: 100.0}))
    before = Path(recipe.output).read_bytes()
    mtime = Path(recipe.output).stat().st_mtime_ns

    d = gate(tracker, B, recipe, trials, check)
    assert not d.promoted
    assert d.checks[failed] == "failed"
    assert d.reasons[0].startswith(f"{failed}: ") and reason in d.reasons[0]
    later = {"confirmation": ("numerics", "regression"), "numerics": ("regression",), "regression": ()}[failed]
    assert all(d.checks[c] == "not run" for c in later)

    assert Path(recipe.output).read_bytes() == before and Path(recipe.output).stat().st_mtime_ns == mtime
    assert _good_run_id(tracker) == first.confirmation_run_id
    assert load_good_policy("gate", uri) == A
    last = tracker.registry.history()[-1]
    assert (last.kind, last.run_id, last.fingerprint) == ("reject", d.decision_run_id, B.fingerprint())
    assert reason in last.reason
    assert last.previous_good_run_id == last.new_good_run_id == first.confirmation_run_id
    rejected = MlflowClient(tracking_uri=uri).get_run(d.confirmation_run_id)
    assert rejected.data.tags["recompute.rejected"] == "true"
    assert rejected.data.tags.get("recompute.good") is None


def test_a_tie_within_noise_goes_to_more_headroom(uri: str, recipe: recipe_mod.Recipe) -> None:
    tracker = Tracker(uri, "gate")
    gate(tracker, A, recipe, FixedTrials({A: 100.0}, peaks={A: 60 * 2**20}))
    # As fast as the good policy and 10 MiB lower: the tie goes to the candidate.
    d = gate(tracker, B, recipe, FixedTrials({A: 100.0, B: 100.0}, peaks={A: 60 * 2**20, B: 50 * 2**20}))
    assert d.promoted and "tie within noise" in d.reason and "the most memory headroom" in d.reason
    # As fast and higher: the good policy keeps its place.
    d = gate(tracker, C, recipe, FixedTrials({B: 100.0, C: 100.0}, peaks={B: 50 * 2**20, C: 55 * 2**20}))
    assert not d.promoted and d.checks["regression"] == "failed"
    assert "won the race against the candidate (tie within noise" in d.reasons[0]


def test_a_good_policy_that_no_longer_runs_does_not_block_a_working_candidate(
    uri: str, recipe: recipe_mod.Recipe
) -> None:
    tracker = Tracker(uri, "gate")
    gate(tracker, A, recipe, FixedTrials({A: 100.0}))
    trials = FixedTrials({A: 100.0, B: 80.0}, outcome={A: "error"})
    d = gate(tracker, B, recipe, trials)
    assert d.promoted
    # The race with it failed, and the good policy alone fails too: nothing to be slower than.
    assert trials.races == [[B, A]] and [c["policy"] for c in trials.calls] == [B, A]
    assert "current good policy failed to run (error: injected error)" in d.reason


def test_the_current_good_policy_as_candidate_changes_nothing(uri: str, recipe: recipe_mod.Recipe) -> None:
    tracker = Tracker(uri, "gate")
    gate(tracker, A, recipe, FixedTrials({A: 100.0}))
    trials = FixedTrials({A: 100.0})
    d = gate(tracker, A, recipe, trials)
    assert d.unchanged and not d.promoted and trials.calls == []
    assert [h.kind for h in tracker.registry.history()] == ["promote"]


def test_promote_promote_rollback_round_trip(uri: str, recipe: recipe_mod.Recipe) -> None:
    tracker = Tracker(uri, "gate")
    a = gate(tracker, A, recipe, FixedTrials({A: 100.0}))
    b = gate(tracker, B, recipe, FixedTrials({A: 100.0, B: 120.0}))
    assert load_good_policy("gate", uri) == B

    restored = tracker.registry.rollback(output_path=recipe.output)
    assert restored.run_id == a.confirmation_run_id and restored.policy == A
    assert RecomputePolicy.load(recipe.output) == A
    assert _good_run_id(tracker) == a.confirmation_run_id
    assert load_good_policy("gate", uri) == A

    history = tracker.registry.history()
    assert [h.kind for h in history] == ["promote", "promote", "rollback"]
    assert [h.seq for h in history] == [1, 2, 3]
    assert [h.new_good_run_id for h in history] == [a.confirmation_run_id, b.confirmation_run_id, a.confirmation_run_id]
    assert history[2].previous_good_run_id == b.confirmation_run_id
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(b.confirmation_run_id).data.tags["recompute.rolled_back"] == "true"
    assert client.get_run(b.confirmation_run_id).data.tags["recompute.good"] == "false"
    assert client.get_run(a.confirmation_run_id).data.tags["recompute.good"] == "true"

    # A second rollback would go before the first promotion: there is nothing there.
    with pytest.raises(TrackingError, match="nothing to roll back to; it has only the first good policy"):
        tracker.registry.rollback(output_path=recipe.output)
    assert RecomputePolicy.load(recipe.output) == A
    # Rollbacks stack with later promotions: promote C, rollback -> A again.
    gate(tracker, C, recipe, FixedTrials({A: 100.0, C: 130.0}))
    assert tracker.registry.rollback(output_path=recipe.output).policy == A
    assert [h.kind for h in tracker.registry.history()] == ["promote", "promote", "rollback", "promote", "rollback"]


def test_rollback_with_nothing_to_roll_back_to(uri: str, recipe: recipe_mod.Recipe) -> None:
    tracker = Tracker(uri, "gate")
    with pytest.raises(TrackingError, match="nothing to roll back to; it has no good policy at all") as info:
        tracker.registry.rollback(output_path=recipe.output)
    assert isinstance(info.value, RecomputeError)
    assert not Path(recipe.output).exists()
    assert tracker.registry.history() == []


def test_rollback_refuses_a_hand_edited_record(uri: str, recipe: recipe_mod.Recipe) -> None:
    tracker = Tracker(uri, "gate")
    gate(tracker, A, recipe, FixedTrials({A: 100.0}))
    gate(tracker, B, recipe, FixedTrials({A: 100.0, B: 120.0}))
    stray = MlflowClient(tracking_uri=uri).create_run(tracker.store.experiment_id).info.run_id
    MlflowClient(tracking_uri=uri).set_experiment_tag(tracker.store.experiment_id, "recompute.good_run_id", stray)
    with pytest.raises(TrackingError, match="changed outside the tuner"):
        tracker.registry.rollback(output_path=recipe.output)


def test_promoting_a_policy_with_a_run_that_measured_another_one_is_refused(
    uri: str, recipe: recipe_mod.Recipe, tmp_path: Path
) -> None:
    tracker = Tracker(uri, "gate")
    with tracker.sessions.session(recipe, study_name="s"):
        run_a = tracker.sessions.log_trial(0, A, LAYERS, None, TrialResult(outcome="ok", throughput=1.0))
    with pytest.raises(TrackingError, match="not the promoted"):
        tracker.registry.promote(B, source_run_id=run_a, output_path=tmp_path / "p.yaml", reason="r", evidence={})
    assert not (tmp_path / "p.yaml").exists()
    assert tracker.registry.current_good() is None
    # Without a source run, the decision run itself holds the policy and becomes the good run.
    decision = tracker.registry.promote(
        B, source_run_id=None, output_path=tmp_path / "p.yaml", reason="by hand", evidence={}
    )
    assert _good_run_id(tracker) == decision
    assert load_good_policy("gate", uri) == B


def test_a_failed_record_puts_the_old_file_back(
    uri: str, recipe: recipe_mod.Recipe, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracker = Tracker(uri, "gate")
    out = tmp_path / "p.yaml"
    tracker.registry.promote(A, source_run_id=None, output_path=out, reason="first", evidence={})
    before = out.read_bytes()

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("tracking server went away")

    monkeypatch.setattr(tracker.store.client, "set_experiment_tag", broken)
    with pytest.raises(RuntimeError, match="went away"):
        tracker.registry.promote(B, source_run_id=None, output_path=out, reason="second", evidence={})
    monkeypatch.undo()
    assert out.read_bytes() == before
    assert load_good_policy("gate", uri) == A
    assert [h.kind for h in tracker.registry.history()] == ["promote"]  # the failed decision run is not history
    client = MlflowClient(tracking_uri=uri)
    failed = client.search_runs([tracker.store.experiment_id], filter_string="tags.`recompute.decision` = 'promote'")
    assert sorted(r.info.status for r in failed) == ["FAILED", "FINISHED"]


def test_evaluate_alone_touches_nothing(recipe: recipe_mod.Recipe) -> None:
    d = evaluate(A, None, recipe=recipe, budget_bytes=None, run_trial=FixedTrials({A: 1.0}), check_numerics=numerics())
    assert d.promoted and d.evidence["regression"] == {"skipped": "no current good policy to compare against"}
    assert not Path(recipe.output).exists()


@pytest.mark.slow
def test_real_trials_promote_on_a_tiny_reference_model(uri: str, tmp_path: Path) -> None:
    """End to end with tuner._trials's real subprocess runner and numerics check (the gate's defaults)."""
    from lightning_recompute.layers import layer_names

    tiny = recipe_mod.from_dict(
        {
            "name": "real",
            "budget": "256MiB",
            "model": {"init_args": {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 16, "vocab_size": 64}},
            "trial": {"warmup_steps": 0, "measure_steps": 1, "timeout_s": 120},
            "tracking": {"uri": uri, "experiment": "real"},
            "output": str(tmp_path / "policy.yaml"),
        }
    )
    names = tuple(layer_names(recipe_mod.build_model(tiny)))
    policy = RecomputePolicy.first_n(names, 1, "full")
    limit = tiny.budget.limit_bytes(None)
    with Tracker(uri, "real") as tracker:
        tracker.sessions.start_session(tiny, study_name="real-cpu")
        d = decide(tracker, Candidate(policy, layer_names=names), recipe=tiny, budget_bytes=limit)
    assert d.promoted, d.reasons
    assert d.evidence["numerics"]["equal"] is True
    assert RecomputePolicy.load(tiny.output) == policy
    assert load_good_policy("real", uri) == policy
    assert d.confirmation_run_id is not None
    run = MlflowClient(tracking_uri=uri).get_run(d.confirmation_run_id)
    assert run.data.tags["recompute.outcome"] == "ok"
    assert 0 < run.data.metrics["measured_peak_bytes"] <= limit
    assert len(MlflowClient(tracking_uri=uri).get_metric_history(run.info.run_id, "step_time_s")) == 3
    assert run.data.params[f"layer.{names[0]}"] == "full" and run.data.params[f"layer.{names[1]}"] == "none"


# ---------------------------------------------------------------------------------------------- a tightened budget


def test_a_good_policy_recorded_over_a_tightened_limit_is_no_contender(uri: str, recipe: recipe_mod.Recipe) -> None:
    tracker = Tracker(uri, "gate")
    gate(tracker, A, recipe, FixedTrials({A: 200.0}, peaks={A: 80 * 2**20}))  # promoted at LIMIT (100 MiB)
    tight = 60 * 2**20
    trials = FixedTrials({A: 200.0, B: 100.0}, peaks={A: 80 * 2**20, B: 50 * 2**20})
    d = decide(
        tracker,
        Candidate(B, layer_names=LAYERS),
        recipe=recipe,
        budget_bytes=tight,
        run_trial=trials,
        check_numerics=numerics(),
    )
    assert d.promoted, d.reasons
    # A is twice as fast, but its recorded 80 MiB peak is over 60 MiB: it is not even re-measured.
    assert [c["policy"] for c in trials.calls] == [B]
    assert "regression: not compared: the current good policy" in d.reason and "no contender" in d.reason
    assert RecomputePolicy.load(recipe.output) == B


def test_a_good_policy_that_peaks_over_the_limit_side_by_side_is_no_contender(recipe: recipe_mod.Recipe) -> None:
    from tuner._tracking import GoodPolicy

    # A good policy without a recorded peak (an older run): the race meters it, under the same limit.
    good = GoodPolicy("run-a", A, A.fingerprint(), throughput=200.0, peak_bytes=None, promoted_at=None)
    trials = FixedTrials({A: 200.0, B: 100.0}, peaks={A: 80 * 2**20, B: 50 * 2**20})
    d = evaluate(
        B,
        good,
        recipe=recipe,
        budget_bytes=60 * 2**20,
        run_trial=trials,
        check_numerics=numerics(),
        run_race=trials.run_race,
    )
    assert d.promoted, d.reasons
    assert "regression: not compared: the current good policy (run run-a) peaked at" in d.reason
    assert "in the race, over the limit" in d.reason and "no contender" in d.reason
    assert trials.races == [[B, A]]


def test_progress_is_told_only_for_checks_that_run(uri: str, recipe: recipe_mod.Recipe) -> None:
    tracker = Tracker(uri, "gate")
    lines: list[str] = []
    gate(tracker, A, recipe, FixedTrials({A: 100.0}), progress=lines.append)
    assert [line.split(" ")[1] for line in lines] == ["confirming", "checking"]
    lines.clear()
    d = gate(tracker, A, recipe, FixedTrials({A: 100.0}), progress=lines.append)
    assert d.unchanged and lines == []


# ---------------------------------------------------------------------------------------------- the file on disk


@pytest.mark.parametrize("damage", ["missing", "garbage", "another policy"])
def test_restore_file_puts_the_good_policy_back(uri: str, recipe: recipe_mod.Recipe, damage: str) -> None:
    tracker = Tracker(uri, "gate")
    assert tracker.registry.restore_file(recipe.output) is None  # no good policy yet: not the tuner's file
    d = gate(tracker, A, recipe, FixedTrials({A: 100.0}))
    out = Path(recipe.output)
    assert tracker.registry.restore_file(out) is None  # matches: untouched
    if damage == "missing":
        out.unlink()
    elif damage == "garbage":
        out.write_bytes(b"\xff\xfe not: [a policy")
    else:
        C.save(out)
    note = tracker.registry.restore_file(out)
    assert note is not None and f"restored the good policy {A.fingerprint()}" in note
    assert d.confirmation_run_id in note
    assert {"missing": "was missing", "garbage": "was not a readable policy", "another policy": "held policy"}[
        damage
    ] in note
    assert RecomputePolicy.load(out) == A


def test_tuned_for_travels_with_promotions_history_rollback_and_mlflow(tmp_path: Path, uri: str) -> None:
    recipe = recipe_mod.from_dict(
        {
            "name": "gate",
            "budget": "128MiB",
            "model": {"init_args": {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 16, "vocab_size": 64}},
            "data": {"init_args": {"batch_size": 8, "vocab_size": 64, "seq_len": 16}},
            "trial": {"warmup_steps": 1, "measure_steps": 4, "timeout_s": 30},
            "tracking": {"uri": uri, "experiment": "gate"},
            "output": str(tmp_path / "out" / "policy.yaml"),
        }
    )
    tracker = Tracker(uri, "gate")
    trials = FixedTrials({A: 100.0, B: 120.0}, peaks={A: 30 * 2**20, B: 40 * 2**20})
    check = numerics()
    a = decide(
        tracker,
        Candidate(A, micro_batch=4),
        recipe=recipe,
        budget_bytes=LIMIT,
        run_trial=trials,
        check_numerics=check,
        run_race=trials.run_race,
    )
    assert a.promoted
    written = RecomputePolicy.load(recipe.output).tuned_for
    assert written is not None
    assert (written.micro_batch, written.data_batch_size, written.peak_bytes, written.limit_bytes) == (
        4,
        8,
        30 * 2**20,
        LIMIT,
    )
    assert (written.device, written.recipe, written.recipe_fingerprint) == ("cpu", "gate", recipe.fingerprint())
    # The good run's artifact is the same file: "mlflow:" training jobs see the same micro-batch.
    assert load_good_policy("gate", uri).tuned_for == written

    # A candidate without a micro-batch of its own was tuned at the data module's batch size.
    b = decide(
        tracker,
        Candidate(B),
        recipe=recipe,
        budget_bytes=LIMIT,
        run_trial=trials,
        check_numerics=check,
        run_race=trials.run_race,
    )
    assert b.promoted
    tuned_b = RecomputePolicy.load(recipe.output).tuned_for
    assert tuned_b is not None and (tuned_b.micro_batch, tuned_b.peak_bytes) == (8, 40 * 2**20)

    restored = tracker.registry.rollback(output_path=recipe.output)
    assert restored.policy.tuned_for == written
    assert RecomputePolicy.load(recipe.output).tuned_for == written
    assert load_good_policy("gate", uri).tuned_for == written
    assert [(h.kind, h.micro_batch) for h in tracker.registry.history()] == [
        ("promote", 4),
        ("promote", 8),
        ("rollback", 4),
    ]


def test_history_and_rollback_survive_a_decision_run_with_a_bad_seq_tag(uri: str, recipe: recipe_mod.Recipe) -> None:
    # One hand-edited recompute.decision_seq tag made `history` fail with ValueError.
    tracker = Tracker(uri, "gate")
    a = gate(tracker, A, recipe, FixedTrials({A: 100.0}))
    gate(tracker, B, recipe, FixedTrials({A: 100.0, B: 120.0}))
    client = MlflowClient(tracking_uri=uri)
    first = client.search_runs([tracker.store.experiment_id], filter_string="tags.`recompute.decision_seq` = '1'")[0]
    client.set_tag(first.info.run_id, "recompute.decision_seq", "one")
    assert [(h.kind, h.seq) for h in tracker.registry.history()] == [("promote", 0), ("promote", 2)]
    assert tracker.registry.rollback(output_path=recipe.output).run_id == a.confirmation_run_id
    assert [h.seq for h in tracker.registry.history()] == [0, 2, 3]


def test_rollback_refuses_an_artifact_changed_after_its_run_logged_it(uri: str, recipe: recipe_mod.Recipe) -> None:
    # rollback used to restore the edited artifact over a correct policy file, exit 0.
    from tuner import _commands as commands

    tracker = Tracker(uri, "gate")
    gate(tracker, A, recipe, FixedTrials({A: 100.0}))
    b = gate(tracker, B, recipe, FixedTrials({A: 100.0, B: 120.0}))
    before = Path(recipe.output).read_bytes()
    MlflowClient(tracking_uri=uri).log_text(b.confirmation_run_id, C.to_yaml(), "policy.yaml")
    with pytest.raises(TrackingError, match="the artifact was changed after the run logged it") as info:
        commands.rollback(recipe)
    assert f"good run {b.confirmation_run_id}: artifact 'policy.yaml' has fingerprint {C.fingerprint()}" in str(
        info.value
    )
    assert Path(recipe.output).read_bytes() == before
    assert [h.kind for h in tracker.registry.history()] == ["promote", "promote"]
    # history still lists the decisions, and says what is wrong with the current one.
    summary = commands.history(recipe)
    assert len(summary.decisions) == 2 and summary.current is None
    assert "artifact was changed" in (summary.current_problem or "")


def test_rollback_refuses_a_policy_over_the_recipe_s_budget_now(uri: str, recipe: recipe_mod.Recipe) -> None:
    # A rollback restored a policy measured at 2.35 MiB against a 2.18 MiB limit without a word.
    import dataclasses

    from tuner import _commands as commands

    tracker = Tracker(uri, "gate")
    a = gate(tracker, A, recipe, FixedTrials({A: 100.0}, peaks={A: 100 * 2**20}))
    gate(tracker, B, recipe, FixedTrials({A: 100.0, B: 120.0}, peaks={A: 100 * 2**20, B: 90 * 2**20}))
    smaller = dataclasses.replace(recipe, budget=Budget(96 * 2**20, 0.05))  # limit 91.2 MiB
    with pytest.raises(RecomputeError, match=r"rollback refused: run \S+ \(\S+\) peaked at 100.00 MiB when measured, "):
        commands.rollback(smaller)
    assert RecomputePolicy.load(recipe.output) == B
    assert [h.kind for h in tracker.registry.history()] == ["promote", "promote"]

    done = commands.rollback(smaller, allow_over_budget=True)
    assert done.good.run_id == a.confirmation_run_id and RecomputePolicy.load(recipe.output) == A
    assert done.budget_note is not None and "over the recipe's budget limit 91.20 MiB" in done.budget_note
    # Within the budget, the summary says so too.
    gate(tracker, B, recipe, FixedTrials({A: 100.0, B: 120.0}, peaks={A: 100 * 2**20, B: 90 * 2**20}))
    done = commands.rollback(recipe)
    assert done.budget_note is not None and done.budget_note.endswith("within the budget limit 121.60 MiB")


def test_a_hand_edited_tuned_for_is_restored_like_the_policy(tmp_path: Path, uri: str) -> None:
    # Editing tuned_for.micro_batch 4 -> 64 in the file was kept: the callback then gave no
    # BatchSizeWarning at batch 16.
    import dataclasses

    recipe = recipe_mod.from_dict(
        {
            "name": "gate",
            "budget": "128MiB",
            "model": {"init_args": {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 16, "vocab_size": 64}},
            "data": {"init_args": {"batch_size": 8, "vocab_size": 64, "seq_len": 16}},
            "tracking": {"uri": uri, "experiment": "gate"},
            "output": str(tmp_path / "policy.yaml"),
        }
    )
    tracker = Tracker(uri, "gate")
    trials = FixedTrials({A: 100.0}, peaks={A: 30 * 2**20})
    decide(
        tracker,
        Candidate(A, micro_batch=4),
        recipe=recipe,
        budget_bytes=LIMIT,
        run_trial=trials,
        check_numerics=numerics(),
    )
    good = RecomputePolicy.load(recipe.output)
    assert good.tuned_for is not None and good.tuned_for.micro_batch == 4
    edited = dataclasses.replace(good, tuned_for=dataclasses.replace(good.tuned_for, micro_batch=64))
    edited.save(recipe.output)
    assert edited.fingerprint() == good.fingerprint()  # the layers are the same: the fingerprint cannot tell

    note = tracker.registry.restore_file(recipe.output)
    assert note is not None and f"held the good policy {good.fingerprint()} with another tuned_for: " in note
    assert "micro_batch 64 (the good run's: 4)" in note
    assert RecomputePolicy.load(recipe.output).tuned_for == good.tuned_for
    assert tracker.registry.restore_file(recipe.output) is None  # now it matches


def test_a_confirmation_far_below_the_race_fails_once_scaled_to_a_trials_process(recipe: recipe_mod.Recipe) -> None:
    import dataclasses

    from tests.tuner.fakes import exact_race

    # The race measured B at 200/s; its confirmation, in its own process, measures 100/s (A, its reference, 150/s).
    race = exact_race([(B, ["trial 1"]), (A, ["trial 2"])], {B.fingerprint(): 1 / 200, A.fingerprint(): 1 / 150}, {})
    trials = FixedTrials({B: 100.0, A: 150.0})
    failed = _gate_b(recipe, trials, dataclasses.replace(race, trial_scale=1.0))
    assert failed.checks["confirmation"] == "failed" and "the race's figure did not hold up" in failed.reasons[0]
    assert "50% below the 200 tokens/s expected" in failed.reasons[0]
    # Trials measured the raced policies at 0.6x their race figures: 100/s is what B's should be (120 +- 25%).
    assert _gate_b(recipe, trials, dataclasses.replace(race, trial_scale=0.6)).promoted
    assert race.calibrated({B.fingerprint(): 120.0, A.fingerprint(): 120.0}).trial_scale == pytest.approx(0.6)


class _Spelled:
    """`run_trial` whose calls measure the given (policy, throughput or outcome) in turn, the load of the
    moment; its `run_race` races at ``race`` (policy -> throughput), failing on an outcome there."""

    def __init__(
        self, runs: list[tuple[RecomputePolicy, float | str]], race: dict[RecomputePolicy, float | str] | None = None
    ) -> None:
        self.runs, self.calls = list(runs), []
        speeds = {p: v for p, v in (race or {}).items() if not isinstance(v, str)}
        outcome = {p: v for p, v in (race or {}).items() if isinstance(v, str)}
        self.racer = FixedTrials({**speeds, **{p: 1.0 for p in outcome}}, outcome=outcome)

    def __call__(self, recipe: Any, policy: RecomputePolicy, **kw: Any) -> Any:
        want, speed = self.runs[len(self.calls)]
        assert policy == want, f"call {len(self.calls)}: ran {policy.to_dict()}, expected {want.to_dict()}"
        self.calls.append((policy, speed))
        if isinstance(speed, str):  # an outcome
            return FixedTrials({policy: 1.0}, outcome={policy: speed})(recipe, policy, **kw)
        return FixedTrials({policy: speed})(recipe, policy, **kw)

    def run_race(self, recipe: Any, entrants: Any, **kw: Any) -> Any:
        return self.racer.run_race(recipe, entrants, **kw)


def _race_b_over_a(reference_policy: bool = True) -> Any:
    """The race measured B at 200/s and A at 150/s (B 1.33x A); A's policy on record unless told not."""
    import dataclasses

    from tests.tuner.fakes import exact_race

    race = exact_race([(B, ["trial 1"]), (A, ["trial 2"])], {B.fingerprint(): 1 / 200, A.fingerprint(): 1 / 150}, {})
    if reference_policy:
        return race
    entrants = {k: dataclasses.replace(e, policy=None) for k, e in race.entrants.items()}
    return dataclasses.replace(race, entrants=entrants)


def _gate_b(recipe: recipe_mod.Recipe, runs: FixedTrials | _Spelled, race: Any, lines: list[str] | None = None) -> Any:
    """`evaluate` of B, alone (no good policy), with ``runs`` as its trial and race runner."""
    return evaluate(
        B,
        None,
        recipe=recipe,
        budget_bytes=LIMIT,
        run_trial=runs,
        check_numerics=numerics(),
        run_race=runs.run_race,
        race=race,
        progress=(lines.append if lines is not None else None),
    )


def test_a_confirmation_slowed_by_a_spell_of_load_is_measured_once_more_and_the_faster_run_counts(
    recipe: recipe_mod.Recipe,
) -> None:
    runs, lines = _Spelled([(B, 100.0), (B, 190.0)]), []  # the first run lands in a spell of load
    d = _gate_b(recipe, runs, _race_b_over_a(), lines)
    assert len(runs.calls) == 2 and runs.racer.races == [] and d.promoted, d.reasons
    assert d.confirmation is not None and d.confirmation.throughput == 190.0
    assert d.evidence["confirmation_slow"]["throughput"] == 100.0
    assert any("did not hold up; measuring once more" in line for line in lines)


def test_a_confirmation_slow_because_the_machine_slowed_passes_on_its_standing_against_a_reference(
    recipe: recipe_mod.Recipe,
) -> None:
    # Slow twice (a loaded node); raced again against A, interleaved, B keeps the race's 1.33x.
    runs, lines = _Spelled([(B, 100.0), (B, 105.0)], race={B: 100.0, A: 75.0}), []
    d = _gate_b(recipe, runs, _race_b_over_a(), lines)
    assert d.promoted and d.checks["confirmation"] == "passed", d.reasons
    assert runs.racer.races == [[B, A]]  # the candidate and the reference, in one race
    assert any("slow again; racing it against FFF (trial 2) interleaved" in line for line in lines)
    held = next(r for r in d.reasons if "kept its standing" in r)
    assert "the machine slowed, not the policy" in held
    assert "1.33x the throughput of FFF (trial 2) raced again interleaved (12 rounds)" in held
    assert "against 1.33x in the session's race" in held
    assert d.evidence["confirmation_race"]["outcome"] == "ok"


def test_a_confirmation_slow_against_the_reference_too_fails_with_both_figures(recipe: recipe_mod.Recipe) -> None:
    # B is slow twice, and raced again it is slower than A: the race's B figure did not hold.
    d = _gate_b(recipe, _Spelled([(B, 100.0), (B, 110.0)], race={B: 100.0, A: 150.0}), _race_b_over_a())
    assert not d.promoted and d.checks["confirmation"] == "failed"
    assert "measured 110 tokens/s" in d.reasons[0] and "did not hold up" in d.reasons[0]
    assert "did not keep its standing either: 0.67x the throughput of FFF (trial 2)" in d.reasons[0]
    # A race that fails leaves the figure against the session's race, which fails, and says why.
    d = _gate_b(recipe, _Spelled([(B, 100.0), (B, 110.0)], race={B: 100.0, A: "oom"}), _race_b_over_a())
    assert not d.promoted and "could not be compared with FFF (trial 2) raced again (failed" in d.reasons[0]


def test_without_a_reference_two_slow_confirmations_fail_and_a_failing_second_run_stands(
    recipe: recipe_mod.Recipe,
) -> None:
    # No other entrant's policy on record: the faster of the two runs is held against the race alone.
    runs = _Spelled([(B, 100.0), (B, 110.0)], race={B: 100.0, A: 75.0})
    d = _gate_b(recipe, runs, _race_b_over_a(reference_policy=False))
    assert len(runs.calls) == 2 and runs.racer.races == [] and not d.promoted
    assert "measured 110 tokens/s" in d.reasons[0] and "standing" not in d.reasons[0]
    # A second run that fails on its own terms (out of memory) is what the gate reports; no race.
    runs = _Spelled([(B, 100.0), (B, "oom")], race={B: 100.0, A: 75.0})
    d = _gate_b(recipe, runs, _race_b_over_a())
    assert not d.promoted and "ended oom" in d.reasons[0] and runs.racer.races == []


def test_a_policy_confirmed_on_batches_that_vary_is_tuned_for_the_largest(recipe: recipe_mod.Recipe) -> None:
    from tuner._gate import tuned_for

    scan = {"varies": True, "largest_samples": 16, "smallest_samples": 1, "scanned": 4, "exhaustive": True}
    conf = TrialResult(outcome="ok", peak_bytes=10, batches={**scan, "largest_index": 3, "largest_elements": 512})
    # The callback warns above tuned_for.micro_batch: the data module's nominal 4 hid its 16-sample batches.
    varying = tuned_for(recipe, Candidate(A), conf, LIMIT)
    assert (varying.micro_batch, varying.data_batch_size) == (16, 16)
    same = TrialResult(outcome="ok", peak_bytes=10, batches={**scan, "varies": False, "largest_samples": 4})
    assert (
        tuned_for(recipe, Candidate(A), same, LIMIT).micro_batch
        == tuned_for(recipe, Candidate(A), None, LIMIT).micro_batch
    )
