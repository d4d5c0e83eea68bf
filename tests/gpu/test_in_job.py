"""Tuning inside the job (`AutoRecompute`) on a device too small to keep every activation."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning as L
import pytest
import torch

from lightning_recompute import QUIET_TRAINER, RecomputePolicy
from lightning_recompute.callback import step_peak
from tests.gpu.common import Device, data, model, quiet

STEPS = 30


def _fit(device: Device, callbacks: list[L.Callback]) -> dict[str, torch.Tensor]:
    """The session model trained `STEPS` steps from seed 0 with ``callbacks``; its weights on the host."""
    cfg = device.sizes.session_model
    net = model(cfg)
    trainer = L.Trainer(accelerator=device.type, devices=1, max_steps=STEPS, callbacks=callbacks, **QUIET_TRAINER)
    with quiet():
        trainer.fit(net, datamodule=data(cfg, device.sizes.session_batch))
    return {k: v.detach().to("cpu", copy=True) for k, v in net.state_dict().items()}


@contextlib.contextmanager
def _capped(device: Device, limit: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The device capped at ``limit`` bytes: the CUDA allocator's per-process fraction, or on the CPU the
    plugin's `RECOMPUTE_CPU_MEMORY_LIMIT` (the steps it meters run out of memory as a GPU's would)."""
    from lightning_recompute.meter import CPU_MEMORY_LIMIT

    if device.cuda:
        total = torch.cuda.get_device_properties(device.torch_device).total_memory
        torch.cuda.set_per_process_memory_fraction(limit / total, device.torch_device)
    else:
        monkeypatch.setenv(CPU_MEMORY_LIMIT, str(limit))
    try:
        yield
    finally:
        if device.cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, device.torch_device)
        else:
            monkeypatch.delenv(CPU_MEMORY_LIMIT)
        device.release()


@pytest.mark.slow  # 30 steps, four times over
def test_in_job_runs_a_step_out_of_memory_again_and_trains_as_a_plain_run(
    device: Device, figures: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`AutoRecompute` on a device capped between ``full``'s and ``none``'s peaks (on CUDA a per-process
    memory fraction, on the CPU ``RECOMPUTE_CPU_MEMORY_LIMIT``), so ``none`` runs out of memory for real.
    Racing ``full`` and ``none``: ``none`` must be out of the race, its step run again under ``full``,
    ``full`` chosen. With no candidates given: the first-batch profile must profile ``none`` from what
    fits and the planner's choice train on. Both runs' weights after 30 steps equal a plain run's
    (bitwise, or within 1e-4 where CUDA kernels are not deterministic)."""
    from lightning_recompute.auto import AutoRecompute
    from lightning_recompute.race import RacePlan

    plan = RacePlan(steps=1, min_rounds=2, max_rounds=4, time_s=1e9, estimate_rounds=2, warmup_steps=1)
    full, none = RecomputePolicy.uniform("full"), RecomputePolicy.uniform("none")
    cfg = device.sizes.session_model
    plain = _fit(device, [])
    device.release()
    peaks = {}
    with quiet():
        for label, p in (("full", full), ("none", none)):
            peaks[label] = step_peak(model(cfg), data(cfg, device.sizes.session_batch), p, accelerator=device.type)
            device.release()
    capped = (peaks["full"] + peaks["none"]) // 2
    figures.update(peak_full_bytes=peaks["full"], peak_none_bytes=peaks["none"], cap_bytes=capped)
    auto = AutoRecompute(10 * peaks["none"], candidates=[full, none], plan=plan)
    planned = AutoRecompute(capped, plan=plan, profile_repeats=1)
    with _capped(device, capped, monkeypatch):
        results = {"given": _fit(device, [auto])}
    with _capped(device, capped, monkeypatch):
        results["planned"] = _fit(device, [planned])
    assert auto.decision is not None and auto.race_result is not None and planned.decision is not None
    out_none = auto.race_result.entrants[none.fingerprint()].out
    bitwise = {k: all(torch.equal(plain[n], w[n]) for n in plain) for k, w in results.items()}
    close = {k: all(torch.allclose(plain[n], w[n], rtol=1e-4, atol=1e-5) for n in plain) for k, w in results.items()}
    figures.update(
        none_out=out_none,
        chosen=auto.decision.short,
        planned_chosen=planned.decision.short,
        planned_notes=planned.notes,
        tuning_steps=auto.tuning_steps,
        weights_bitwise_equal=bitwise,
        max_abs_diff={k: max(float((plain[n] - w[n]).abs().max()) for n in plain) for k, w in results.items()},
        summary=auto.decision.summary,
        planned_summary=planned.decision.summary,
    )

    assert (out_none or "").startswith("out of memory"), f"none under a {capped} B cap: {out_none or 'raced'}"
    assert auto.decision.policy.fingerprint() == full.fingerprint(), f"chose {auto.decision.summary}"
    assert any("does not fit with every layer in none" in n for n in planned.notes), (
        f"the profile did not split none: {planned.notes}"
    )
    trains = {k: bitwise[k] or (device.cuda and close[k]) for k in results}
    assert all(trains.values()), f"weights after {STEPS} steps vs a plain run: {figures['max_abs_diff']}"
    if not device.cuda:
        assert bitwise == {"given": True, "planned": True}
        assert peaks["full"] < capped < peaks["none"] and auto.tuning_steps > 0, figures
        assert set(auto.decision.short) == {"F"}
