"""The Optuna study: search space shape, params <-> policy, seeding once, constraint, skips, duplicates.

Fast: no trial subprocess runs here; trial results are built by hand.
"""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState

from lightning_recompute.errors import RecomputeError
from lightning_recompute.planner import Prediction
from lightning_recompute.policy import RecomputePolicy
from tuner._search import (
    FAR_OVER_BUDGET,
    LayerInfo,
    SearchSpace,
    Seed,
    TuningStudy,
    baseline_seeds,
    far_over_budget,
    inspect_layers,
    study_name,
)
from tuner._stores import open_storage
from tuner._trials import TrialResult
from tuner.recipe import from_dict


def _prediction(peak_bytes: int) -> Prediction:
    """A planner prediction with only a peak that matters."""
    return Prediction(
        peak_bytes=peak_bytes, step_time_s=0.1, micro_batch=1, peak_at="bwd:0", base_bytes=0, layers=(), estimated=False
    )


MIB = 1 << 20


def _recipe(**model_args):
    return from_dict(
        {"budget": "64MiB", "model": {"init_args": {"n_embd": 32, "seq_len": 32, "n_head": 2, **model_args}}}
    )


def _alike(n: int) -> list[LayerInfo]:
    return [LayerInfo(f"blocks.{i}", "k") for i in range(n)]


def _ok(throughput: float, peak: int) -> TrialResult:
    return TrialResult(
        outcome="ok",
        peak_bytes=peak,
        step_time_s=1.0,
        throughput=throughput,
        throughput_unit="tokens/s",
        step_times_s=(1.0,),
        device="cpu",
    )


def _open(tmp_path, space: SearchSpace, budget: int = 10 * MIB, name: str = "s") -> TuningStudy:
    return TuningStudy.open(name=name, storage=str(tmp_path / "optuna.log"), space=space, budget_bytes=budget)


# ---------------------------------------------------------------------------------------------- the space


def test_alike_layers_give_a_grouped_space_whose_size_does_not_grow_with_depth():
    small = SearchSpace.for_layers(inspect_layers(_recipe(n_layer=3)), ("none", "selective", "full"))
    deep = SearchSpace.for_layers(inspect_layers(_recipe(n_layer=8)), ("none", "selective", "full"))
    assert small.grouped and deep.grouped
    assert set(small.distributions()) == set(deep.distributions()) == {"n_full", "n_selective", "placement"}
    n_full = deep.distributions()["n_full"]
    assert isinstance(n_full, IntDistribution) and n_full.high == 8


def test_heterogeneous_layers_give_one_categorical_per_layer():
    layers = inspect_layers(_recipe(widths=[32, 64, 32]))
    assert len({layer.kind for layer in layers}) > 1  # the 64-wide block differs in parameter shapes
    space = SearchSpace.for_layers(layers, ("none", "selective", "full"))
    assert not space.grouped
    dists = space.distributions()
    assert set(dists) == {"layer.blocks.0", "layer.blocks.1", "layer.blocks.2"}
    layer = dists["layer.blocks.1"]
    assert isinstance(layer, CategoricalDistribution) and layer.choices == ("none", "selective", "full")


def test_micro_batch_is_a_parameter_only_when_several_sizes_are_searched():
    assert "micro_batch" not in SearchSpace.for_layers(_alike(3), ("none", "full"), (8,)).distributions()
    dists = SearchSpace.for_layers(_alike(3), ("none", "full"), (4, 8)).distributions()
    micro_batch = dists["micro_batch"]
    assert isinstance(micro_batch, CategoricalDistribution) and micro_batch.choices == (4, 8)


def test_grouped_params_build_the_policy_deterministically():
    space = SearchSpace.for_layers(_alike(4), ("none", "selective", "full"))
    names = space.layer_names

    def short(**params):
        return space.decode(params)[0].short(names)

    assert short(n_full=1, n_selective=2, placement="first") == "Fss."
    assert short(n_full=1, n_selective=2, placement="last") == ".ssF"
    assert short(n_full=2, n_selective=0, placement="spread") == "F.F."
    assert short(n_full=2, n_selective=2, placement="spread") == "FsFs"
    # Counts past the layers left are clipped, the strongest mode first.
    assert short(n_full=3, n_selective=3, placement="first") == "FFFs"


def test_fill_mode_is_the_weakest_mode_searched():
    space = SearchSpace.for_layers(_alike(3), ("selective", "full"))
    assert space.fill_mode == "selective" and space.counted_modes == ("full",)
    assert space.decode({"n_full": 1, "placement": "last"})[0].short(space.layer_names) == "ssF"


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_every_baseline_is_exactly_in_the_grouped_space(n):
    space = SearchSpace.for_layers(_alike(n), ("none", "selective", "full"))
    seeds = baseline_seeds(space)
    assert [s.name for s in seeds] == [
        "baseline:none",
        "baseline:full",
        "baseline:selective",
        "baseline:every_2nd_full",
    ]
    for seed in seeds:
        params = space.encode(seed.modes)
        assert params is not None, seed.name
        assert space.modes_of(params) == dict(seed.modes)
    every = space.policy(seeds[-1].modes).short(space.layer_names)
    assert every == "".join("F" if i % 2 == 0 else "." for i in range(n))


def test_an_arrangement_outside_the_grouped_space_keeps_its_counts():
    space = SearchSpace.for_layers(_alike(4), ("none", "selective", "full"))
    modes = dict(
        zip(space.layer_names, ["full", "none", "selective", "full"], strict=False)
    )  # F.sF: no placement makes it
    assert space.encode(modes) is None
    params = space.nearest(modes)
    assert params == {"n_full": 2, "n_selective": 1, "placement": "first"}


def test_policies_are_canonical_so_equal_decisions_share_a_fingerprint():
    space = SearchSpace.for_layers(_alike(3), ("none", "full"))
    a = space.decode({"n_full": 3, "placement": "first"})[0]
    b = space.decode({"n_full": 3, "placement": "spread"})[0]
    assert a == b and a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != RecomputePolicy.uniform("full").fingerprint()  # a glob is another policy file


def test_study_name_is_the_recipe_name_hardware_and_fingerprint():
    recipe = _recipe(n_layer=3)
    name = study_name(recipe, "NVIDIA H200")
    assert name == f"recipe.nvidia-h200.{recipe.fingerprint()[:8]}"
    assert study_name(_recipe(n_layer=4), "NVIDIA H200") != name  # another model: another study


def test_storage_urls_and_journal_files(tmp_path):
    assert isinstance(open_storage(f"sqlite:///{tmp_path / 'a.db'}"), optuna.storages.RDBStorage)
    assert isinstance(open_storage(str(tmp_path / "sub" / "j.log")), optuna.storages.JournalStorage)
    with pytest.raises(RecomputeError, match="neither a database URL nor a journal file"):
        open_storage(str(tmp_path / "x.txt"))


# ---------------------------------------------------------------------------------------------- the study


def test_seeding_happens_once_and_a_resumed_study_is_not_seeded_again(tmp_path):
    space = SearchSpace.for_layers(_alike(3), ("none", "selective", "full"))
    first = _open(tmp_path, space)
    assert first.created
    names = first.seed(baseline_seeds(space))
    assert names == ["baseline:none", "baseline:full", "baseline:selective", "baseline:every_2nd_full"]
    assert len(first.waiting()) == 4

    again = _open(tmp_path, space)
    assert not again.created
    assert again.wait_or_take_setup(0.0, 60.0) is None  # the session sees the mark and does not seed
    # Even a second seeding (a session taking over an abandoned setup) skips what is there.
    assert again.seed(baseline_seeds(space)) == []
    assert len(again.waiting()) == 4


def test_a_planner_seed_equal_to_a_baseline_is_enqueued_once(tmp_path):
    space = SearchSpace.for_layers(_alike(3), ("none", "full"))
    study = _open(tmp_path, space)
    dup = Seed("planner:budget", {n: "full" for n in space.layer_names})
    assert study.seed([*baseline_seeds(space), dup]) == ["baseline:none", "baseline:full", "baseline:every_2nd_full"]


def test_a_study_refuses_another_search_space(tmp_path):
    _open(tmp_path, SearchSpace.for_layers(_alike(3), ("none", "full")))
    with pytest.raises(RecomputeError, match="another search space"):
        _open(tmp_path, SearchSpace.for_layers(_alike(4), ("none", "full")))


def test_over_budget_trials_are_never_best(tmp_path):
    space = SearchSpace.for_layers(_alike(2), ("none", "full"))
    study = _open(tmp_path, space, budget=10 * MIB)
    study.seed(baseline_seeds(space))
    fast = study.ask()  # baseline:none
    study.tell_result(fast, _ok(900.0, 12 * MIB))  # measured, fastest, but over the limit
    slow = study.ask()  # baseline:full
    study.tell_result(slow, _ok(500.0, 6 * MIB))
    assert study.study.trials[0].state == TrialState.COMPLETE
    assert study.study.trials[0].constraints == {"peak_minus_budget": float(2 * MIB)}
    assert study.study.best_trial.number == slow.number  # Optuna's own answer honours the constraint
    best = study.best()
    assert best is not None and best.number == slow.number
    assert not study.records()[0].feasible


def test_a_candidate_predicted_far_over_budget_is_skipped_not_run(tmp_path):
    budget = 10 * MIB
    assert far_over_budget(_prediction(int(1.2 * budget)), budget) is None  # within the planner's error
    assert far_over_budget(None, budget) is None
    reason = far_over_budget(_prediction(int(2 * budget)), budget)
    assert reason is not None and f"{FAR_OVER_BUDGET:g}x the budget" in reason

    space = SearchSpace.for_layers(_alike(2), ("none", "full"))
    study = _open(tmp_path, space, budget=budget)
    study.seed(baseline_seeds(space))
    proposal = study.ask()
    proposal.prediction = _prediction(2 * budget)
    frozen = study.tell_skipped(proposal, reason)
    assert frozen.state == TrialState.PRUNED
    assert frozen.user_attrs["outcome"] == "skipped" and frozen.user_attrs["reason"] == reason
    assert frozen.constraints["peak_minus_budget"] > 0
    assert study.ran_count() == 0 and study.best() is None


def test_a_duplicate_policy_is_not_measured_twice(tmp_path):
    space = SearchSpace.for_layers(_alike(2), ("none", "full"))
    study = _open(tmp_path, space)
    params = space.encode({n: "full" for n in space.layer_names})
    assert params is not None
    study.study.enqueue_trial(params)
    study.study.enqueue_trial({**params, "placement": "spread"})  # other params, same policy
    first = study.ask()
    assert first.duplicate_of is None
    study.tell_result(first, _ok(500.0, MIB))
    second = study.ask()
    assert second.duplicate_of is not None and second.duplicate_of.number == first.number
    frozen = study.tell_duplicate(second)
    # The sampler sees the same value again (not a "bad" pruned trial); the table counts one measurement.
    assert frozen.state == TrialState.COMPLETE and frozen.value == 500.0
    assert study.ran_count() == 1
    assert [r.outcome for r in study.records()] == ["ok", "duplicate"]
    assert study.records()[1].throughput is None  # figures stay with the trial that measured them


def test_a_running_duplicate_is_the_original_once_claimed_and_contended_before(tmp_path):
    space = SearchSpace.for_layers(_alike(2), ("none", "full"))
    study = _open(tmp_path, space)
    params = space.encode({n: "none" for n in space.layer_names})
    assert params is not None
    for _ in range(3):
        study.study.enqueue_trial(params)
    a, b = study.ask(), study.ask()  # both running, as two workers would hold them
    assert a.duplicate_of is None and a.contended_by is None  # a saw nobody: it may measure
    # a's worker has not decided yet (it may be standing down for b): b must not count on it.
    assert b.duplicate_of is None and b.contended_by is not None and b.contended_by.number == a.number
    study.tell_interrupted(b, "stood down")
    study.claim(a)
    c = study.ask()
    assert c.duplicate_of is not None and c.duplicate_of.number == a.number and c.contended_by is None
    assert study.tell_duplicate(c).state == TrialState.FAIL  # a's figures are not known yet


def test_a_seed_asked_after_a_claimed_trial_of_its_candidate_is_a_duplicate_whatever_the_numbers(tmp_path, monkeypatch):
    space = SearchSpace.for_layers(_alike(2), ("full",))  # one candidate: the sampler proposes it too
    one = _open(tmp_path, space)
    other = TuningStudy.open(name="s", storage=str(tmp_path / "optuna.log"), space=space, budget_bytes=10 * MIB)
    params = space.encode({n: "full" for n in space.layer_names})
    assert params is not None
    one.study.enqueue_trial(params)  # trial 0, waiting
    # The other worker read the queue before the seed landed: it asks a fresh trial, numbered after
    # the seed, of the same candidate, and claims it.
    monkeypatch.setattr(other.study, "_pop_waiting_trial_id", lambda: None)
    fresh = other.ask()
    assert fresh.duplicate_of is None and fresh.contended_by is None
    other.claim(fresh)
    seed = one.ask()
    assert seed.number < fresh.number
    # Numbers do not follow the order of asking: the seed asked last is the duplicate.
    assert seed.duplicate_of is not None and seed.duplicate_of.number == fresh.number


def test_an_interrupted_seed_goes_back_in_the_queue(tmp_path):
    space = SearchSpace.for_layers(_alike(2), ("none", "full"))
    study = _open(tmp_path, space)
    study.seed(baseline_seeds(space))
    waiting = len(study.waiting())
    proposal = study.ask()
    assert proposal.label == "baseline:none"
    frozen = study.tell_interrupted(proposal, "interrupted by the user")
    assert frozen.state == TrialState.FAIL and frozen.user_attrs["outcome"] == "interrupted"
    assert len(study.waiting()) == waiting  # one taken, one put back
    assert not study.running()
    again = study.ask()
    assert again.label == "baseline:full"  # the queue goes on; the re-queued seed comes last
    assert again.duplicate_of is None
    # The interrupted trial is not evidence: the same seed, asked again, is measured, not a duplicate.
    for _ in range(len(study.waiting())):
        p = study.ask()
        if p.label == "baseline:none":
            assert p.duplicate_of is None
            break
    else:
        pytest.fail("the interrupted seed was not re-queued")


def test_failed_trials_are_told_fail_with_their_outcome(tmp_path):
    space = SearchSpace.for_layers(_alike(2), ("none", "full"))
    study = _open(tmp_path, space)
    study.seed(baseline_seeds(space))
    proposal = study.ask()
    frozen = study.tell_result(proposal, TrialResult(outcome="oom", error="CUDA out of memory", device="cpu"))
    assert frozen.state == TrialState.FAIL
    record = study.records()[0]
    assert record.outcome == "oom" and record.reason == "CUDA out of memory"
    assert record.ran and not record.measured  # it ran to an outcome, and produced no figures
    assert not frozen.constraints and not record.feasible  # no peak: infeasible


def test_every_outcome_a_trial_can_end_with_is_a_record_outcome():
    from typing import get_args

    from tuner._search.study import MEASURED, NOT_EVIDENCE, RAN, RecordOutcome
    from tuner._trials import Outcome

    record_outcomes = set(get_args(RecordOutcome))
    assert set(get_args(Outcome)) <= record_outcomes
    assert set(RAN) | {"skipped"} | set(NOT_EVIDENCE) == record_outcomes
    # "measured" means the same for a record as for the result it records: memory and speed figures.
    for outcome in get_args(Outcome):
        assert (outcome in MEASURED) == TrialResult(outcome=outcome).measured
        assert (outcome in RAN) == (outcome != "skipped")


def test_where_a_trial_came_from_is_read_from_its_label_in_one_place() -> None:
    from tuner._search.space import Source

    assert Source.of("baseline:every_2nd_full") is Source.BASELINE
    assert Source.of("planner:front2@mb4") is Source.PLANNER
    assert Source.of(None) is Source.SEARCH and Source.of("") is Source.SEARCH
