"""`lightning_recompute.auto.AutoRecompute`: tuning inside the training job, on CPU, with real steps.

What a user relies on: the weights are those of a plain run (bitwise, dropout on, every tuning step
and switch included), the chosen policy fits, a candidate over the limit runs once and never again,
an out-of-memory step is run again under the safest candidate without changing training, the
decision survives a checkpoint, and the record is a tuning session's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_recompute import RecomputePolicy, applied_policy
from lightning_recompute.auto import AutoRecompute
from lightning_recompute.race import RacePlan
from lightning_recompute.reference import ReferenceGPT, SyntheticTokens

TINY = dict(vocab_size=64, seq_len=32, n_layer=3, n_embd=32, n_head=4, dropout=0.1)
DATA = dict(vocab_size=64, seq_len=32, batch_size=4, num_batches=64)
PLAN = RacePlan(steps=1, min_rounds=2, max_rounds=3, time_s=1e9, estimate_rounds=2, warmup_steps=1)
NAMES = [f"blocks.{i}" for i in range(3)]
FULL = RecomputePolicy.uniform("full")
NONE = RecomputePolicy.uniform("none")
STEPS = 48


def _fit(
    trainer_factory: Callable[..., L.Trainer], callbacks: list[Any], steps: int = STEPS, **kw: Any
) -> ReferenceGPT:
    L.seed_everything(0, verbose=False)
    model = ReferenceGPT(**TINY)
    trainer = trainer_factory(max_steps=steps, callbacks=callbacks, **kw)
    trainer.fit(model, datamodule=SyntheticTokens(**DATA))
    return model


def _assert_bitwise(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    differ = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not differ, f"weights differ from a plain run: {differ[:5]}"


def _policies_per_step(auto: AutoRecompute) -> dict[int, set[str | None]]:
    out: dict[int, set[str | None]] = {}
    for r in auto.records:
        out.setdefault(r.step, set()).add(r.policy)
    return out


def test_tuning_steps_are_training_steps_and_the_winner_trains_on(quiet_trainer: Callable[..., L.Trainer]) -> None:
    plain = _fit(quiet_trainer, [])
    auto = AutoRecompute("1GiB", plan=PLAN, profile_repeats=1)
    tuned = _fit(quiet_trainer, [auto])
    _assert_bitwise(plain, tuned)
    assert auto.decision is not None and auto.race_result is not None
    # The planner's candidates, safest (lowest predicted peak) first, all predicted to fit.
    predicted = [c.predicted_peak_bytes for c in auto.candidates]
    assert len(auto.candidates) >= 2 and all(p is not None for p in predicted)
    assert predicted == sorted(predicted)  # type: ignore[type-var]
    assert all(p <= auto.limit_bytes for p in predicted)  # type: ignore[operator]
    assert "planner:budget" in {c.label for c in auto.candidates}
    # Several candidates really ran, then only the winner, which is what the model has on now.
    ran = Counter(r.policy for r in auto.records)
    assert len(ran) >= 2
    last = auto.records[-1]
    assert last.policy == auto.decision.policy.fingerprint()
    applied = applied_policy(tuned)
    assert applied is not None and applied.policy.fingerprint() == auto.decision.policy.fingerprint()
    after = [r for r in auto.records if r.step >= auto.tuning_steps + PLAN.warmup_steps]
    assert after and {r.policy for r in after} == {auto.decision.policy.fingerprint()}
    # The chosen policy fits: its measured peak is within the limit.
    peak = auto.race_result.entrants[auto.decision.policy.fingerprint()].peak_bytes
    assert peak is not None and peak <= auto.limit_bytes


def test_a_candidate_over_the_limit_runs_once_and_never_again(quiet_trainer: Callable[..., L.Trainer]) -> None:
    probe = AutoRecompute("1GiB", candidates=[FULL, NONE], plan=PLAN)
    _fit(quiet_trainer, [probe])
    assert probe.race_result is not None
    peaks = {k: e.peak_bytes for k, e in probe.race_result.entrants.items()}
    full_peak, none_peak = peaks[FULL.fingerprint()], peaks[NONE.fingerprint()]
    assert full_peak is not None and none_peak is not None and full_peak < none_peak
    between = (full_peak + none_peak) // 2
    auto = AutoRecompute(between, margin=0.0, candidates=[FULL, NONE], plan=PLAN)
    plain = _fit(quiet_trainer, [])
    tuned = _fit(quiet_trainer, [auto])
    _assert_bitwise(plain, tuned)
    assert auto.decision is not None and auto.decision.policy.fingerprint() == FULL.fingerprint()
    ran = Counter(r.policy for r in auto.records)
    assert ran[NONE.fingerprint()] == 1  # its first (metered) step, then out
    assert auto.race_result is not None
    out = auto.race_result.entrants[NONE.fingerprint()].out
    assert out is not None and "over the limit" in out


def test_gradient_accumulation_switches_only_between_optimizer_steps(
    quiet_trainer: Callable[..., L.Trainer],
) -> None:
    plain = _fit(quiet_trainer, [], accumulate_grad_batches=2)
    auto = AutoRecompute("1GiB", candidates=[FULL, NONE, RecomputePolicy.first_n(NAMES, 1, "full")], plan=PLAN)
    tuned = _fit(quiet_trainer, [auto], accumulate_grad_batches=2)
    _assert_bitwise(plain, tuned)
    per_step = _policies_per_step(auto)
    assert all(len(p) == 1 for p in per_step.values()), "a policy changed inside an optimizer step"
    assert Counter(r.step for r in auto.records).most_common(1)[0][1] == 2  # two micro-batches per step
    assert len({next(iter(p)) for p in per_step.values()}) == 3


def test_an_out_of_memory_step_runs_again_under_the_safest_candidate(
    quiet_trainer: Callable[..., L.Trainer],
) -> None:
    """A candidate that runs out of memory is out; its batch runs again from the same random state, so
    training is a plain run's (no batch skipped, no dropout mask changed)."""
    plain = _fit(quiet_trainer, [])
    auto = AutoRecompute("1GiB", candidates=[FULL, NONE], plan=PLAN, catch_oom=True)
    L.seed_everything(0, verbose=False)
    model = ReferenceGPT(**TINY)
    raised: list[int] = []

    def oom_under_none(module: torch.nn.Module, args: Any) -> None:
        applied = applied_policy(model)
        if applied is not None and applied.policy.fingerprint() == NONE.fingerprint():
            raised.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

    model.blocks[1].register_forward_pre_hook(oom_under_none)
    trainer = quiet_trainer(max_steps=STEPS, callbacks=[auto])
    trainer.fit(model, datamodule=SyntheticTokens(**DATA))
    _assert_bitwise(plain, model)
    assert raised == [1]
    assert auto.race_result is not None
    out = auto.race_result.entrants[NONE.fingerprint()].out
    assert out is not None and out.startswith("out of memory")
    assert auto.decision is not None and auto.decision.policy.fingerprint() == FULL.fingerprint()
    assert NONE.fingerprint() not in {r.policy for r in auto.records}  # the retried step is filed under full
    assert any("ran out of memory" in n for n in auto.notes)


def test_an_out_of_memory_error_in_the_optimizers_update_is_not_run_again(
    quiet_trainer: Callable[..., L.Trainer],
) -> None:
    """After the closure (forward and backward) the update may be half applied: the error stands."""

    class OomAfterTheClosureUnderNone(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
                applied = applied_policy(pl_module)
                if applied is not None and applied.policy.fingerprint() == NONE.fingerprint():
                    raise torch.OutOfMemoryError("CUDA out of memory in the update (simulated)")

            trainer.optimizers[0].register_step_post_hook(after_step)

    auto = AutoRecompute("1GiB", candidates=[FULL, NONE], plan=PLAN, catch_oom=True)
    with pytest.raises(torch.OutOfMemoryError, match="in the update"):
        _fit(quiet_trainer, [auto, OomAfterTheClosureUnderNone()])
    assert auto.notes == []  # nothing was retried


def test_resuming_keeps_the_decision_and_does_not_tune_again(
    quiet_trainer: Callable[..., L.Trainer], tmp_path: Path
) -> None:
    auto = AutoRecompute("1GiB", candidates=[FULL, NONE], plan=PLAN)
    L.seed_everything(0, verbose=False)
    model = ReferenceGPT(**TINY)
    trainer = quiet_trainer(max_steps=STEPS, callbacks=[auto], enable_checkpointing=True)
    trainer.fit(model, datamodule=SyntheticTokens(**DATA))
    assert auto.decision is not None
    ckpt = tmp_path / "done.ckpt"
    trainer.save_checkpoint(ckpt)
    again = AutoRecompute("1GiB", candidates=[FULL, NONE], plan=PLAN)
    trainer2 = quiet_trainer(max_steps=STEPS + 6, callbacks=[again])
    trainer2.fit(ReferenceGPT(**TINY), datamodule=SyntheticTokens(**DATA), ckpt_path=ckpt)
    assert again.schedule is None and again.candidates == []
    assert again.decision is not None and again.decision.policy.fingerprint() == auto.decision.policy.fingerprint()
    assert [r.step for r in again.records] == list(range(STEPS, STEPS + 6))
    assert {r.policy for r in again.records} == {auto.decision.policy.fingerprint()}


def test_a_job_that_ends_while_tuning_still_decides(quiet_trainer: Callable[..., L.Trainer]) -> None:
    auto = AutoRecompute("1GiB", candidates=[FULL, NONE], plan=RacePlan(steps=1, min_rounds=50, max_rounds=60))
    _fit(quiet_trainer, [auto], steps=9)
    assert auto.decision is not None and auto.race_result is not None
    assert auto.race_result.stop.startswith("the job ended after")


def test_bad_arguments_name_the_argument_and_what_is_valid() -> None:
    from lightning_recompute.errors import RecomputeError

    with pytest.raises(RecomputeError, match="budget"):
        AutoRecompute("lots")
    with pytest.raises(RecomputeError, match=r"margin: must be in \[0, 1\)"):
        AutoRecompute("1GiB", margin=1.5)
    with pytest.raises(RecomputeError, match="max_candidates: must be an integer >= 2"):
        AutoRecompute("1GiB", max_candidates=1)


def test_the_record_is_a_tuning_session_nested_in_the_jobs_run_and_the_policy_file_has_tuned_for(
    quiet_trainer: Callable[..., L.Trainer], tmp_path: Path, uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow import MlflowClient

    from lightning_recompute import as_policy
    from tuner._tracking.names import BEST_FINGERPRINT, IN_JOB, KIND, PARENT, RACE_JSON, RACE_WINNER

    # MLflow's run-context tags ask `git` for the commit: a process the fast tier does not start.
    monkeypatch.setattr("lightning.pytorch.loggers.mlflow._get_resolve_tags", lambda: lambda tags=None: tags or {})
    logger = MLFlowLogger(experiment_name="job", tracking_uri=uri)
    output = tmp_path / "policy.yaml"
    auto = AutoRecompute("1GiB", candidates=[FULL, NONE], plan=PLAN, output=output)
    _fit(quiet_trainer, [auto], logger=logger)
    assert auto.decision is not None and auto.record_run_id is not None
    policy = as_policy(output)
    assert policy.fingerprint() == auto.decision.policy.fingerprint()
    assert policy.tuned_for is not None
    assert policy.tuned_for.micro_batch == DATA["batch_size"] and policy.tuned_for.limit_bytes == auto.limit_bytes
    assert policy.tuned_for.peak_bytes is not None and policy.tuned_for.peak_bytes <= auto.limit_bytes
    client = MlflowClient(uri)
    session = client.get_run(auto.record_run_id)
    tags = session.data.tags
    assert tags[KIND] == "session" and tags[IN_JOB] == "true" and tags[PARENT] == logger.run_id
    assert tags[BEST_FINGERPRINT] == tags[RACE_WINNER] == auto.decision.policy.fingerprint()
    assert session.info.status == "FINISHED"
    assert session.info.experiment_id == logger.experiment_id
    trials = client.search_runs([logger.experiment_id], f"tags.`{PARENT}` = '{auto.record_run_id}'")
    assert sorted(t.data.tags[KIND] for t in trials) == ["trial", "trial"]
    for t in trials:
        steps = client.get_metric_history(t.info.run_id, "step_time_s")
        assert len(steps) >= PLAN.min_rounds  # one per round it ran
        assert t.data.metrics["measured_peak_bytes"] > 0
    artifacts = {a.path for a in client.list_artifacts(auto.record_run_id)}
    assert {RACE_JSON, "trials.csv", "best_policy.yaml"} <= artifacts


def test_a_batchnorm_model_tuned_in_the_job_ends_with_the_state_of_a_plain_run(
    quiet_trainer: Callable[..., L.Trainer],
) -> None:
    """The first-batch profile, the race's switches between policies and the winner's steps all update
    BatchNorm's statistics exactly as a run without recomputation does."""
    from tests.plugin.stateful_models import StatefulNet, differing, images, state

    def fit(callbacks: list[Any]) -> StatefulNet:
        L.seed_everything(0, verbose=False)
        model = StatefulNet("batchnorm")
        quiet_trainer(max_steps=16, callbacks=callbacks, limit_val_batches=0).fit(model, images(n=96))
        return model

    plain = state(fit([]))
    auto = AutoRecompute("1GiB", plan=PLAN, profile_repeats=1)
    tuned = state(fit([auto]))
    assert len({r.policy for r in auto.records}) >= 2  # the race switched policies between steps
    assert not differing(plain, tuned)


# ---------------------------------------------------------------------------------------------- the capped CPU


def _small_gpt_fit(make: Callable[..., L.Trainer], steps: int) -> Callable[[list[Any]], ReferenceGPT]:
    def fit(callbacks: list[Any]) -> ReferenceGPT:
        L.seed_everything(0, verbose=False)
        model = ReferenceGPT(vocab_size=64, seq_len=64, n_layer=4, n_embd=32, n_head=4, dropout=0.1)
        data = SyntheticTokens(vocab_size=64, seq_len=64, batch_size=4, num_batches=64)
        make(max_steps=steps, callbacks=callbacks, limit_val_batches=0).fit(model, data)
        return model

    return fit


def test_on_a_device_where_none_does_not_fit_the_job_profiles_decides_and_trains_as_a_plain_run(
    quiet_trainer: Callable[..., L.Trainer], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_recompute.meter import CPU_MEMORY_LIMIT
    from tests.capped import cap_between

    fit = _small_gpt_fit(quiet_trainer, steps=20)
    plain = fit([])  # uncapped
    cap = cap_between(_small_gpt_fit(quiet_trainer, steps=2))
    monkeypatch.setenv(CPU_MEMORY_LIMIT, str(cap))
    auto = AutoRecompute(cap, plan=PLAN, profile_repeats=1)
    tuned = fit([auto])
    assert any("does not fit with every layer in none" in n for n in auto.notes), auto.notes
    assert auto.decision is not None and any(c.label == "planner:budget" for c in auto.candidates)
    assert all(r.peak_bytes is None or r.peak_bytes <= cap for r in auto.records)
    _assert_bitwise(plain, tuned)


def test_a_candidate_that_runs_out_of_memory_on_the_capped_device_is_out_and_its_step_runs_again(
    quiet_trainer: Callable[..., L.Trainer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Explicit candidates, the one that keeps everything first: its first step runs out of memory for
    real, the same batch runs again under full, and BatchNorm's statistics and the weights equal a plain
    run's (the failed forward's updates to the statistics undone)."""
    from lightning_recompute.meter import CPU_MEMORY_LIMIT
    from tests.capped import cap_between
    from tests.plugin.stateful_models import StatefulNet, differing, images, state

    def fit(steps: int) -> Callable[[list[Any]], StatefulNet]:
        def run(callbacks: list[Any]) -> StatefulNet:
            L.seed_everything(0, verbose=False)
            model = StatefulNet("batchnorm", channels=16)
            quiet_trainer(max_steps=steps, callbacks=callbacks, limit_val_batches=0).fit(model, images(n=96, size=16))
            return model

        return run

    plain = state(fit(12)([]))
    cap = cap_between(fit(2))
    monkeypatch.setenv(CPU_MEMORY_LIMIT, str(cap))
    auto = AutoRecompute(cap, candidates=[NONE, FULL], plan=PLAN)
    tuned = state(fit(12)([auto]))
    assert any("ran out of memory in a step; it is out" in n for n in auto.notes), auto.notes
    assert auto.decision is not None and auto.decision.policy == FULL
    assert not differing(plain, tuned)


def test_catching_out_of_memory_is_refused_with_gradient_accumulation(quiet_trainer: Callable[..., L.Trainer]) -> None:
    from lightning_recompute.errors import RecomputeError

    auto = AutoRecompute("1GiB", candidates=[FULL, NONE], plan=PLAN, catch_oom=True)
    with pytest.raises(
        RecomputeError, match=r"catch_oom=True: not with gradient accumulation \(accumulate_grad_batches=2\)"
    ):
        _fit(quiet_trainer, [auto], accumulate_grad_batches=2)
