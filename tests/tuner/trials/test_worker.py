"""The child side of a trial, run in this process: what it meters is what `step_peak` measures."""

from __future__ import annotations

import pytest

from lightning_recompute import RecomputePolicy, step_peak
from tuner._trials import worker
from tuner.recipe import build_datamodule, build_model, from_dict

RECIPE = {
    "model": {"init_args": {"n_layer": 3, "n_embd": 32, "seq_len": 16, "n_head": 2, "vocab_size": 64}},
    "data": {"init_args": {"batch_size": 4, "num_batches": 4}},
    "budget": "64MiB",
    "search": {"seed": 0},
}


@pytest.mark.parametrize("glyphs", ["none", "full", "mixed"])
def test_a_trials_steady_peak_is_step_peak_of_the_same_recipe_and_policy(glyphs: str) -> None:
    recipe = from_dict(RECIPE)
    policy = {
        "none": RecomputePolicy.uniform("none"),
        "full": RecomputePolicy.uniform("full"),
        "mixed": RecomputePolicy.from_modes({"blocks.0": "full", "blocks.1": "selective"}),
    }[glyphs]
    spec = {"recipe": recipe.to_dict(), "policy": policy.to_dict(), "warmup_steps": 1, "measure_steps": 1}
    steps = worker._trial(spec)["steps"]
    # The trial meters the warm-up step and the one after it (optimizer state allocated): the peak it checks.
    trial_peak = steps[1]["peak_bytes"]
    assert trial_peak == step_peak(build_model(recipe), build_datamodule(recipe), policy, layers=recipe.layers)


NAN_RECIPE = {**RECIPE, "model": {**RECIPE["model"], "class_path": "tests.tuner.faulty.NanLoss"}}


def test_a_trial_whose_loss_is_not_finite_is_its_own_outcome(monkeypatch: pytest.MonkeyPatch) -> None:
    # A nan loss used to be an `ok` trial, its speed and peak taken as evidence for the policy.
    recipe = from_dict(NAN_RECIPE)
    spec = {
        "recipe": recipe.to_dict(),
        "policy": RecomputePolicy.uniform("full").to_dict(),
        "warmup_steps": 1,
        "measure_steps": 1,
    }
    res = worker._trial(spec)
    assert res["outcome"] == "nonfinite"
    assert res["error"].startswith("the training loss was nan at step 1 of 3;"), res["error"]

    # The parent keeps the outcome and the message (a worker run stands in for the subprocess).
    from tuner._trials import runner

    done = runner._WorkerRun(returncode=0, result=res, tail="", wall_s=1.0, timed_out=False)
    monkeypatch.setattr(runner, "_run_worker", lambda *a, **k: done)
    trial = runner.run_trial(recipe, RecomputePolicy.uniform("full"))
    assert (trial.outcome, trial.error, trial.measured) == ("nonfinite", res["error"], False)


def test_the_numerics_check_says_when_the_run_without_recompute_is_not_finite() -> None:
    # It used to blame the policy: "42 of 42 values differ ... bitwise equality is the rule on CPU".
    recipe = from_dict(NAN_RECIPE)
    res = worker._numerics({"recipe": recipe.to_dict(), "policy": RecomputePolicy.uniform("full").to_dict()})
    assert res["equal"] is False
    assert res["detail"].startswith("the run without recompute is itself non-finite at micro-batch 4 (loss nan"), res[
        "detail"
    ]


def test_every_measured_step_is_metered_so_a_leak_shows_where_it_peaks() -> None:
    # On CPU only the warm-up and one step after it were metered: a model keeping 512 KiB more each
    # step was promoted on its second step's peak while its later steps went over the budget.
    from tuner._trials import summarize_steps

    recipe = from_dict({**RECIPE, "model": {**RECIPE["model"], "class_path": "tests.tuner.faulty.Leaks"}})
    spec = {
        "recipe": recipe.to_dict(),
        "policy": RecomputePolicy.uniform("none").to_dict(),
        "warmup_steps": 1,
        "measure_steps": 4,
    }
    res = worker._trial(spec)
    peaks = [s["peak_bytes"] for s in res["steps"]]
    assert all(p is not None for p in peaks[:5]), peaks  # warm-up and all four measured steps
    leak = 512 * 1024
    assert peaks[4] >= peaks[1] + 3 * leak, peaks  # the leak is seen growing to the last measured step
    stats = summarize_steps(res["steps"], int(res["warmup_steps"]))
    assert stats["peak_bytes"] == max(peaks[:5])
    assert len(stats["step_times_s"]) == 4  # timed on the unmetered steps after them


VARYING = {**RECIPE, "data": {"class_path": "tests.tuner.faulty.VaryingBatches", "init_args": {"num_batches": 4}}}


def test_a_trial_on_batches_that_vary_measures_every_step_on_the_largest_and_says_so() -> None:
    # Batches of 1, 8, 2, 16 samples: a 2-step trial metered the 1- and 8-sample batches and passed a
    # budget that the 16-sample batch exceeds.
    from tuner._trials import summarize_steps
    from tuner._trials.batches import BatchScan

    recipe = from_dict(VARYING)
    spec = {"recipe": recipe.to_dict(), "policy": RecomputePolicy.uniform("none").to_dict(), "warmup_steps": 1}
    res = worker._trial({**spec, "measure_steps": 2})
    scan = BatchScan(**res["batches"])
    assert (scan.varies, scan.exhaustive, scan.scanned, scan.largest_index) == (True, True, 4, 3)
    assert (scan.smallest_samples, scan.largest_samples, scan.largest_elements) == (1, 16, 2 * 16 * 16)
    assert "every measured step uses the largest, batch 3 (16 samples" in scan.describe()
    assert {s["samples"] for s in res["steps"]} == {16}
    # Its peak is that of a job whose every batch is the largest: nominal batch size 16, no variation.
    fixed = from_dict({**RECIPE, "data": {"init_args": {"batch_size": 16, "num_batches": 4}}})
    peak = summarize_steps(res["steps"], 1)["peak_bytes"]
    assert peak == step_peak(build_model(fixed), build_datamodule(fixed), RecomputePolicy.uniform("none"))

    # Batches that do not vary reach the trainer unchanged, and the scan says how many were seen.
    same = worker._trial({**spec, "recipe": from_dict(RECIPE).to_dict(), "measure_steps": 1})
    assert same["batches"]["varies"] is False and same["batches"]["scanned"] == 4
    assert {s["samples"] for s in same["steps"]} == {4}


def test_a_scan_shorter_than_the_epoch_says_a_larger_batch_may_come_later() -> None:
    import torch

    from tuner._trials.batches import scan

    found, largest = scan([torch.zeros(n, 2) for n in (1, 3, 2, 9)], limit=3)
    assert found is not None and not found.exhaustive and found.scanned == 3 and found.varies
    assert largest.shape == (3, 2) and found.largest_index == 1
    assert "the first 3; a larger batch may come later" in found.describe()
    assert scan([], limit=3) == (None, None)


# ---------------------------------------------------------------------------------------------- numerics


def _step(loss: float, *grads: float) -> tuple[object, dict[str, object]]:
    import torch

    return torch.tensor(loss), {f"gradient of w{i}": torch.full((2,), g) for i, g in enumerate(grads)}


def _verdict(pol: tuple[object, dict[str, object]], **kw: object) -> object:
    base = _step(1.0, 0.5, 0.25)
    again = kw.pop("again", base)
    args = {"compiled": False, "on_cpu": True, "where": "at micro-batch 4", "gradients": "parameter", **kw}
    return worker._compare((base, again, pol), **args)  # type: ignore[arg-type]


def test_one_comparison_serves_one_process_and_every_rank() -> None:
    # One device and N ranks once compared with two drifted copies: only one-device accepted a compiled policy
    # within the compiled-layer tolerance, and each told CPU from accelerator its own way.
    same = _verdict(_step(1.0, 0.5, 0.25), gradients="local", where="on rank 1 (ddp) at micro-batch 2")
    assert (same.equal, same.max_abs_diff, same.baseline_spread) == (True, 0.0, 0.0)
    assert same.detail == (
        "loss, 2 local gradients, 0 parameters and 0 buffers bitwise equal on rank 1 (ddp) at micro-batch 2"
    )

    close = _step(1.0, 0.5 + 2**-20, 0.25)  # within rtol 1e-4 / atol 1e-5, not bitwise
    assert _verdict(close, compiled=True).equal
    assert "within the compiled-layer tolerance (rtol 0.0001, atol 1e-05)" in _verdict(close, compiled=True).detail
    eager = _verdict(close)
    assert not eager.equal and eager.detail.endswith("bitwise equality is the rule on CPU"), eager.detail
    assert eager.detail.startswith(
        "1 of 3 tensors (loss, 2 parameter gradients, 0 parameters and 0 buffers) differ at micro-batch 4, "
        "first gradient of w0, most at gradient of w0"
    ), eager.detail

    # Off CPU the policy may differ by what two runs without it differ by; on CPU it may not.
    noisy = _step(1.0, 0.5 + 2**-10, 0.25)
    assert _verdict(close, again=noisy, on_cpu=False).equal
    assert (
        "within the spread 0.000977 of two runs without recompute" in _verdict(close, again=noisy, on_cpu=False).detail
    )
    assert not _verdict(close, again=noisy, on_cpu=True).equal
    far = _verdict(noisy, again=close, on_cpu=False)
    assert not far.equal and far.detail.endswith("two runs without recompute differ by 9.54e-07"), far.detail


def test_the_numerics_result_is_every_field_of_the_runners_and_the_device() -> None:
    from dataclasses import fields

    from tuner._trials import NumericsResult

    recipe = from_dict(RECIPE)
    res = worker._numerics({"recipe": recipe.to_dict(), "policy": RecomputePolicy.uniform("full").to_dict()})
    assert set(res) == {"outcome", "device", "device_total_bytes", *(f.name for f in fields(NumericsResult))}
    got = NumericsResult(**{f.name: res[f.name] for f in fields(NumericsResult)})
    assert (res["outcome"], got.equal, got.max_abs_diff, got.micro_batch, res["device"]) == ("ok", True, 0.0, 4, "cpu")
    assert got.detail == (
        "loss, 41 parameter gradients, 41 parameters, 0 buffers and the eval-mode loss bitwise equal at micro-batch 4"
    ), got.detail


BATCHNORM_RECIPE = {
    "model": {"class_path": "tests.plugin.stateful_models.StatefulNet", "init_args": {"kind": "batchnorm"}},
    "data": {"class_path": "tests.plugin.stateful_models.Images", "init_args": {"batch_size": 4}},
    "budget": "64MiB",
    "search": {"seed": 0},
}


def test_the_numerics_check_looks_at_every_buffer_and_names_the_first_that_differs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning_recompute import apply

    recipe = from_dict(BATCHNORM_RECIPE)
    spec = {"recipe": recipe.to_dict(), "policy": RecomputePolicy.uniform("full").to_dict()}
    res = worker._numerics(spec)
    assert res["equal"] and res["detail"] == (
        "loss, 22 parameter gradients, 22 parameters, 18 buffers and the eval-mode loss bitwise equal at micro-batch 4"
    ), res["detail"]
    # The replay without its buffers restored (as before it was): the loss and every gradient are still
    # equal, the running statistics are not, and the check says which.
    monkeypatch.setattr(apply, "Replay", lambda forward, caches: forward.inner)
    res = worker._numerics(spec)
    assert not res["equal"]
    assert "first blocks.0.bn1.running_mean," in res["detail"], res["detail"]
    assert "gradient of" not in res["detail"].split("most at")[1], res["detail"]


def test_a_buffer_that_holds_inf_by_design_is_no_non_finite_run() -> None:
    import torch

    loss, grads = _step(1.0, 0.5)
    step = (loss, {**grads, "mask": torch.tensor([0.0, float("-inf")])})
    verdict = worker._compare((step, step, step), compiled=False, on_cpu=True, where="here", gradients="parameter")
    assert verdict.equal, verdict.detail
