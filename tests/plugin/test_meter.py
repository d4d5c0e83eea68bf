"""The CPU storage meter agrees with hand-computed tensor sizes; recompute modes order as they must."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_recompute import RecomputePolicy, StorageMeter, apply_policy, memory_meter
from lightning_recompute.meter import CudaMemoryMeter, StepTimer
from lightning_recompute.reference import Block, ReferenceGPT

B, T, C, H = 2, 16, 32, 4
E = 4  # bytes per float32
BTC, BHTT = B * T * C, B * H * T * T


def test_meter_counts_allocations_views_and_frees_exactly() -> None:
    with StorageMeter() as meter:
        a = torch.empty(1000)  # 4000 bytes
        assert meter.current_bytes == 4000
        v = a.view(10, 100)[2:]  # a view is not memory
        a.add_(1)  # in place: not memory
        b = a * 2  # 4000 more
        assert meter.current_bytes == 8000
        del a
        assert meter.current_bytes == 8000  # the view keeps the storage alive
        del v
        assert meter.current_bytes == 4000
        c = torch.empty(10, 10, dtype=torch.float16)  # 200 bytes
        del b, c
        assert meter.current_bytes == 0
        assert meter.peak_bytes == 8000  # a + b; c came after a was freed
        meter.reset_peak()
        assert meter.peak_bytes == 0


def test_track_counts_existing_tensors_once() -> None:
    model = nn.Linear(10, 10)  # 100 + 10 floats
    meter = StorageMeter()
    meter.track(model, model.weight, [model.bias])
    assert meter.current_bytes == 110 * E


def test_meta_device_meter_counts_without_allocating() -> None:
    with StorageMeter("meta") as meter:
        x = torch.empty(1 << 30, device="meta")  # 4 GiB that never exist
        y = x * 2
        assert meter.current_bytes == 2 * (1 << 32)
        del x, y
    assert meter.current_bytes == 0


def test_memory_meter_picks_by_device() -> None:
    assert isinstance(memory_meter("cpu"), StorageMeter)
    assert isinstance(memory_meter("cuda:0"), CudaMemoryMeter)
    with pytest.raises(ValueError, match="valid: cuda, cpu, meta"):
        memory_meter("xla")


def _kept_by_block(mode: str) -> int:
    """Bytes a block keeps from its forward for its backward (its input and output excluded)."""
    torch.manual_seed(0)
    stack = nn.Sequential(Block(C, H, 0.1, "eager", 4, C), Block(C, H, 0.1, "eager", 4, C))
    apply_policy(stack, RecomputePolicy.from_modes({"0": mode}))
    x = torch.randn(B, T, C, requires_grad=True)
    with StorageMeter() as meter:
        out = stack[0](x)
        kept = meter.current_bytes - out.untyped_storage().nbytes()
    return kept


def test_per_layer_activation_bytes_match_tensor_sizes_and_order() -> None:
    # Eager attention, dropout on, fp32. On CPU dropout keeps a float32 mask of its input's size.
    # none: ln1/ln2 mean+rstd (4*B*T), ln1 out, q, k^T, v copies, context, attn-resid mask, x1,
    # ln2 out (8 x BTC), fc out + gelu out (8 x BTC), mlp mask (1 x BTC), softmax out, attention
    # dropout mask and output (3 x BHTT), the causal mask (T*T bools).
    none = 17 * BTC * E + 3 * BHTT * E + 4 * B * T * E + T * T
    # selective keeps only the outputs of the four GEMMs against weights: qkv 3C, proj C, fc 4C, fc_out C.
    selective = 9 * BTC * E
    # full keeps nothing but the layer input, which its caller holds anyway.
    full = 0
    assert (_kept_by_block("none"), _kept_by_block("selective"), _kept_by_block("full")) == (none, selective, full)
    assert none > selective > full


def _step_profile(policy: str, n_layer: int) -> tuple[int, int]:
    """(bytes kept at the end of forward, peak during the step) over a plain step of the reference model."""
    torch.manual_seed(0)
    model = ReferenceGPT(vocab_size=64, seq_len=T, n_layer=n_layer, n_embd=C, n_head=H, dropout=0.1)
    apply_policy(model, RecomputePolicy.uniform(policy))
    x = torch.randint(0, 64, (B, T))
    with StorageMeter() as meter:
        loss = model.loss((x, x))
        forward_end = meter.current_bytes
        loss.backward()
    return forward_end, meter.peak_bytes


def test_full_keeps_one_input_per_layer_and_peaks_at_one_layer_of_activations() -> None:
    f2, _ = _step_profile("full", 2)
    f4, peak4 = _step_profile("full", 4)
    # Two more layers under full keep exactly two more layer inputs (B, T, C) fp32.
    assert f4 - f2 == 2 * BTC * E
    # Backward climbs above the forward level by one layer's recomputed activations (at least)
    # plus the parameter gradients that exist by then (at most all of them).
    one_layer = 17 * BTC * E + 3 * BHTT * E + 4 * B * T * E + T * T
    params4 = (
        sum(p.numel() for p in ReferenceGPT(vocab_size=64, seq_len=T, n_layer=4, n_embd=C, n_head=H).parameters()) * E
    )
    assert one_layer <= peak4 - f4 <= one_layer + params4
    n_none, peak_none = _step_profile("none", 4)
    assert peak4 < peak_none and f4 < n_none


def test_step_timer_measures_with_patched_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter([10.0, 10.25])
    monkeypatch.setattr("lightning_recompute.meter.perf_counter", lambda: next(ticks))
    timer = StepTimer("cpu")
    assert timer.stop() is None
    timer.start()
    assert timer.stop() == 0.25


# ---------------------------------------------------------------------------------------------- the capped CPU


def test_the_cap_raises_the_out_of_memory_error_a_gpu_raises_and_frees_what_it_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning_recompute.meter import CPU_MEMORY_LIMIT

    monkeypatch.setenv(CPU_MEMORY_LIMIT, "1KiB")
    big = torch.ones(1024)  # 4 KiB, tracked: what existed before the meter counts, and never raises
    with StorageMeter() as meter:
        meter.track(big)
        with pytest.raises(torch.OutOfMemoryError, match=r"CPU out of memory: tried to allocate 16 bytes .*1024 bytes"):
            torch.zeros(4)
        assert meter.current_bytes == 4096  # the refused allocation is off the ledger again
    monkeypatch.setenv(CPU_MEMORY_LIMIT, "lots")
    with pytest.raises(ValueError, match=r"RECOMPUTE_CPU_MEMORY_LIMIT: 'lots' is not a size \(valid: .*MiB"):
        StorageMeter()
    monkeypatch.setenv(CPU_MEMORY_LIMIT, "")
    with StorageMeter() as meter:
        torch.zeros(1 << 20)  # unset: no limit


def test_a_model_that_does_not_fit_without_recomputation_runs_out_of_memory_and_fits_with_it(
    monkeypatch: pytest.MonkeyPatch, quiet_trainer: Any
) -> None:
    import lightning as L

    from lightning_recompute import RecomputeCallback
    from lightning_recompute.meter import CPU_MEMORY_LIMIT
    from lightning_recompute.reference import SyntheticTokens

    def fit(mode: str) -> RecomputeCallback:
        L.seed_everything(0, verbose=False)
        model = ReferenceGPT(vocab_size=64, seq_len=64, n_layer=4, n_embd=32, n_head=4, dropout=0.1)
        cb = RecomputeCallback(RecomputePolicy.uniform(mode))
        data = SyntheticTokens(vocab_size=64, seq_len=64, batch_size=4, num_batches=4)
        quiet_trainer(max_steps=2, callbacks=[cb], limit_val_batches=0).fit(model, data)
        return cb

    none_peak = max(r.peak_bytes or 0 for r in fit("none").records)
    full_peak = max(r.peak_bytes or 0 for r in fit("full").records)
    cap = (none_peak + full_peak) // 2
    monkeypatch.setenv(CPU_MEMORY_LIMIT, str(cap))
    with pytest.raises(torch.OutOfMemoryError, match="over the limit"):
        fit("none")
    capped = fit("full")  # trains under the cap, measuring what it measured uncapped
    assert len(capped.records) == 2 and max(r.peak_bytes or 0 for r in capped.records) == full_peak < cap
