"""Compiled layers: recomputation lowers the compiled step's peak and trains to the same weights."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lightning as L
import pytest
import torch

from lightning_recompute import QUIET_TRAINER, RecomputeCallback, RecomputePolicy
from lightning_recompute.apply import COMPILED_ATOL, COMPILED_RTOL
from lightning_recompute.reference import ReferenceGPT
from tests.gpu.common import Device, data, model, quiet


class _SGDReferenceGPT(ReferenceGPT):
    """`ReferenceGPT` trained by plain SGD, so weights after a step differ exactly as the gradients do.

    AdamW's first step divides each gradient by its own magnitude: a 1e-9 difference in a gradient
    near zero would move a weight by up to the learning rate, and weights would look unequal when
    the gradients agree to the compiled tolerance.
    """

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@contextlib.contextmanager
def _compile_backend(backend: str | None) -> Iterator[None]:
    """torch.compile with ``backend`` for the plugin's ``compile: true`` (which takes the default, Inductor)."""
    if backend is None:
        yield
        return
    real = torch.compile
    torch.compile = functools.partial(real, backend=backend)
    try:
        yield
    finally:
        torch.compile = real


@dataclass(frozen=True)
class _CompiledRun:
    peak_bytes: int | None
    """The last step's peak: the CUDA allocator's, Inductor's buffers included; on CPU an eager step's."""
    weights: dict[str, torch.Tensor]
    graphs: int
    """Graphs dynamo compiled: a compile check that compiled nothing would prove nothing."""


def _compiled_run(device: Device, mode: str, steps: int) -> _CompiledRun:
    """``steps`` steps of the ``mode`` policy with ``compile: true``: the last step's peak, the weights after all."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    cfg = device.sizes.compile_model
    torch._dynamo.reset()  # each run compiles its own graphs, as a trial's fresh process does
    counters.clear()
    # On CUDA every step is metered by the allocator and runs compiled. On CPU a metered step runs its
    # compiled layers eagerly (the ledger is a dispatch mode, docs/TUNER.md), so only the last step is metered:
    # the ones before it run compiled.
    metered = None if device.cuda else range(steps - 1, steps)
    callback = RecomputeCallback(RecomputePolicy.uniform(mode, compile=True), memory_steps=metered)
    trainer = L.Trainer(accelerator=device.type, devices=1, max_steps=steps, callbacks=[callback], **QUIET_TRAINER)
    net = model(cfg, cls=_SGDReferenceGPT)
    with quiet(), _compile_backend(device.sizes.compile_backend):
        trainer.fit(net, datamodule=data(cfg, device.sizes.compile_batch))
    return _CompiledRun(
        peak_bytes=callback.records[-1].peak_bytes,
        weights={n: p.detach().float().cpu().clone() for n, p in net.named_parameters()},
        graphs=int(counters["stats"]["unique_graphs"]),
    )


@pytest.mark.slow  # compiles
def test_compile_recomputes_with_equal_weights(device: Device, figures: dict[str, Any]) -> None:
    """A compiled policy (``compile: true``) with ``full`` against the same compiled model with ``none``:
    the step's peak as the CUDA allocator sees it (Inductor's buffers included) is lower with recomputation,
    and the weights after three SGD steps are equal (bitwise, or within the plugin's compiled tolerance).
    The CPU dry run compiles with ``aot_eager`` (Inductor costs about a minute per graph on CPU), and its
    peak is an eager step's: the CPU ledger runs compiled layers eagerly, as it cannot see compiled code."""
    steps = 3  # the first compiles; the peak is the last one's
    none = _compiled_run(device, "none", steps)
    device.release()
    full = _compiled_run(device, "full", steps)
    device.release()
    base, got = none.weights, full.weights
    figures.update(
        backend=device.sizes.compile_backend or "inductor",
        graphs_none=none.graphs,
        graphs_full=full.graphs,
        peak_is_compiled=device.cuda,
        peak_none_bytes=none.peak_bytes,
        peak_full_bytes=full.peak_bytes,
        weights_bitwise_equal=all(torch.equal(got[n], w) for n, w in base.items()),
        weights_within_tolerance=all(
            torch.allclose(got[n], w, rtol=COMPILED_RTOL, atol=COMPILED_ATOL) for n, w in base.items()
        ),
        max_abs_diff=max(float((got[n] - w).abs().max()) for n, w in base.items()),
    )

    assert none.graphs > 0 and full.graphs > 0, f"compiled nothing: {none.graphs} + {full.graphs} graphs"
    assert none.peak_bytes is not None and full.peak_bytes is not None, "no peak recorded"
    assert full.peak_bytes < none.peak_bytes, f"peak full {full.peak_bytes} B >= none {none.peak_bytes} B"
    assert figures["weights_within_tolerance"], (
        f"weights after {steps} steps: max abs diff {figures['max_abs_diff']:.3g} "
        f"(tolerance rtol {COMPILED_RTOL:g} atol {COMPILED_ATOL:g})"
    )
    if not device.cuda:
        assert figures["backend"] == "aot_eager"
