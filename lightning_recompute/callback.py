"""`RecomputeCallback`: apply a recompute policy in a Lightning run and log what it costs (docs/PLUGIN.md); and
`step_peak`, the one way trials, benchmarks and tests measure a training step's peak under a policy."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, cast

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader, Dataset

from lightning_recompute.apply import AppliedPolicy, CompiledCall, applied_policy, apply_policy
from lightning_recompute.errors import (
    BatchSizeError,
    BatchSizeWarning,
    IncompatibleModelError,
    LayerDiscoveryError,
    RecomputeError,
)
from lightning_recompute.grads import GradFreeing, decide_grad_freeing, free_gradients
from lightning_recompute.layers import LayerSpec, find_layers
from lightning_recompute.meter import MemoryMeter, StepTimer, StorageMeter, memory_meter
from lightning_recompute.policy import PolicyLike
from lightning_recompute.sources import as_policy
from lightning_recompute.tuned_for import batch_advice


@dataclass(frozen=True)
class StepRecord:
    """What the callback measured for one training batch."""

    step: int  # trainer.global_step before the batch
    seconds: float  # device work included
    peak_bytes: int | None  # None: not measured
    samples: int
    tokens: int | None  # None: no sequence dimension
    policy: str | None = None  # the fingerprint of the policy the batch ran under

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float | None:
        if self.tokens is None:
            return None
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


# Strategies that wrap the model after `configure_model`, so a policy must be applied inside it
# (FSDP2 and tensor parallel keep module paths: applying after them is fine; see docs/PLUGIN.md).
_SHARDING_STRATEGIES = ("FSDPStrategy", "DeepSpeedStrategy")


class RecomputeCallback(L.Callback):
    """Apply a per-layer recompute policy (anything `as_policy` takes) to the LightningModule and log its memory
    and speed each step, keeping the last ``max_records`` in `records` (docs/PLUGIN.md, 'The callback').
    ``memory_steps``: the global steps whose peak is measured (``None``: every step); ``strict_batch_size``:
    raise `BatchSizeError` instead of warning when a batch is larger than the policy's ``tuned_for.micro_batch``.
    """

    def __init__(
        self,
        policy: PolicyLike,
        layers: LayerSpec = "auto",
        measure_memory: bool = True,
        memory_steps: Collection[int] | None = None,
        max_records: int = 10_000,
        strict_batch_size: bool = False,
        free_grads_at_batch_start: bool | None = None,
    ) -> None:
        self.policy = as_policy(policy)
        self.layers = layers
        self.measure_memory = measure_memory
        self.memory_steps = None if memory_steps is None else frozenset(int(s) for s in memory_steps)
        self.records: deque[StepRecord] = deque(maxlen=max_records)
        self.strict_batch_size = strict_batch_size
        self.free_grads_at_batch_start = free_grads_at_batch_start
        self.applied: AppliedPolicy | None = None
        self.grad_freeing: GradFreeing | None = None
        self._batch_checked = False
        self._deferred = False
        self._meter: MemoryMeter | None = None
        self._timer: StepTimer | None = None
        self._step: int | None = None  # the global step of the batch running
        self._metering: MemoryMeter | None = None  # the meter, on a step it measures

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if getattr(trainer.strategy, "_activation_checkpointing_kwargs", None):
            raise IncompatibleModelError(
                f"{type(trainer.strategy).__name__} has activation_checkpointing_policy set, and RecomputeCallback "
                f"is also given a policy: each layer would be recomputed twice. Remove one of them."
            )
        try:
            find_layers(pl_module, self.layers)
        except LayerDiscoveryError:
            if not is_overridden("configure_model", pl_module):
                raise
            self._deferred = True  # the layers may not exist yet: configure_model runs after this hook
            return
        self.applied = apply_policy(pl_module, self.policy, self.layers)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._deferred:
            self._finish_deferred(trainer, pl_module)
        self._timer = StepTimer(pl_module.device)
        self._meter = memory_meter(pl_module.device) if self.measure_memory else None
        if isinstance(self._meter, StorageMeter) and _compiled(pl_module):
            # Inductor allocates outside the dispatcher, where the CPU ledger watches: report no figure.
            self._meter = None
            rank_zero_warn(
                "RecomputeCallback: the model runs torch.compile'd code on CPU, whose allocations the storage "
                "ledger cannot see; recompute/peak_memory_bytes is not logged (StepRecord.peak_bytes is None). "
                "On CUDA the allocator's statistics count compiled code too."
            )
        if self.applied is not None:
            rank_zero_info(f"RecomputeCallback: applied policy\n{self.applied.describe()}")
        self.grad_freeing = decide_grad_freeing(self.free_grads_at_batch_start, trainer, pl_module, self)
        rank_zero_info(self.grad_freeing.describe())

    def switch_policy(self, pl_module: L.LightningModule, policy: PolicyLike, *, retry: bool = False) -> AppliedPolicy:
        """Put ``policy`` on the model for the batches that follow: between batches, or with ``retry=True``
        mid-batch for a step about to be run again from its start."""
        if self._step is not None and not retry:
            raise RecomputeError("RecomputeCallback.switch_policy: called while a batch runs; call it between batches")
        new = as_policy(policy)
        self.applied = apply_policy(pl_module, new, self.layers)
        self.policy = new
        return self.applied

    def _finish_deferred(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        already = applied_policy(pl_module)
        if already is not None:
            if already.policy.fingerprint() != self.policy.fingerprint():
                rank_zero_warn(
                    f"RecomputeCallback: configure_model applied policy {already.policy.fingerprint()}, not the "
                    f"callback's {self.policy.fingerprint()}; the one applied in configure_model is in effect."
                )
            self.applied = already
            return
        strategy = type(trainer.strategy).__name__
        if strategy in _SHARDING_STRATEGIES:
            raise RecomputeError(
                f"{type(pl_module).__name__} builds its layers in configure_model and runs under {strategy}, which "
                f"wraps them right after; the callback cannot apply the policy that late. Call "
                f"`lightning_recompute.apply_policy(self, policy)` at the end of configure_model, before sharding "
                f"(the callback then only logs)."
            )
        self.applied = apply_policy(pl_module, self.policy, self.layers)

    def _check_batch_size(self, trainer: L.Trainer, batch: Any) -> bool:
        """Warn (or raise) when ``batch`` exceeds the tuned micro-batch; whether checking is over."""
        tuned = self.policy.tuned_for
        if tuned is None or tuned.micro_batch is None or (seen := _batch_size(batch)) is None:
            return True  # nothing to compare, now or later
        if seen <= tuned.micro_batch:
            return False
        global_batch = seen * int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        size, steps = batch_advice(tuned.micro_batch, global_batch)
        where = f" on {tuned.device}" if tuned.device else ""
        measured = f" ({tuned.figures()}{where})" if tuned.figures() else where
        message = (
            f"RecomputeCallback: policy {self.policy.fingerprint()} was tuned for micro-batch {tuned.micro_batch}"
            f"{measured}, but this job trains at batch size {seen}: its activations grow with the batch, so it "
            f"will likely not fit the limit it was tuned for. Set batch_size={size}, "
            f"accumulate_grad_batches={steps} to keep the global batch of {global_batch}, or tune again at "
            f"micro-batch {seen}."
        )
        if self.strict_batch_size:
            raise BatchSizeError(message)
        rank_zero_warn(message, category=BatchSizeWarning)
        return True

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._batch_checked:
            # Every batch until one is too large: with variable lengths the first can be the smallest.
            self._batch_checked = self._check_batch_size(trainer, batch)
        # Before the meter starts; StochasticWeightAveraging's extra epoch skips backward (`_skip_backward`).
        freeing = self.grad_freeing is not None and self.grad_freeing.enabled
        if freeing and not getattr(trainer.fit_loop, "_skip_backward", False):
            free_gradients(trainer.optimizers)
        if self._timer is None:
            return
        self._step = trainer.global_step
        measured = self.memory_steps is None or self._step in self.memory_steps
        self._metering = self._meter if measured else None
        if self._metering is not None:
            # The CPU ledger only sees storages created while it runs: count what already lives.
            self._metering.track(pl_module, *trainer.optimizers, batch)
            self._metering.start()
        self._timer.start()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._timer is None or self._step is None:
            return
        seconds = self._timer.stop()
        peak = None if self._metering is None else self._metering.peak_bytes
        if self._metering is not None:
            self._metering.stop()
        if seconds is None:
            return
        record = StepRecord(
            self._step, seconds, peak, _batch_size(batch) or 1, _tokens(batch), policy=self.policy.fingerprint()
        )
        self._step = None
        self.records.append(record)
        metrics = {
            "recompute/step_time_s": record.seconds,
            "recompute/samples_per_s": record.samples_per_s,
            "recompute/tokens_per_s": record.tokens_per_s,
            "recompute/peak_memory_bytes": None if peak is None else float(peak),
        }
        for name, value in metrics.items():
            if value is not None:
                pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=record.samples)

    def _stop_meter(self) -> None:
        if self._meter is not None:
            self._meter.stop()
        self._step = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop_meter()  # a step that raised (an OOM, a KeyboardInterrupt) never reached on_train_batch_end

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._stop_meter()
        if isinstance(self._meter, StorageMeter):
            self._meter.close()  # detach the ledger's finalizers from storages that outlive the run (parameters)
        self._meter = None

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.to_dict(), "fingerprint": self.policy.fingerprint()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("fingerprint")
        if saved is not None and saved != self.policy.fingerprint():
            rank_zero_warn(
                f"RecomputeCallback: the checkpoint was written under recompute policy {saved}; resuming under "
                f"{self.policy.fingerprint()}. Training numerics are unaffected; memory use and speed may differ."
            )


QUIET_TRAINER: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
"""The ``Trainer`` keywords of a measurement run: no logger, checkpoint, progress bar or summary."""


def step_peak(
    model: L.LightningModule,
    data: L.LightningDataModule | DataLoader | Sequence[Any],
    policy: PolicyLike,
    *,
    step: int = 1,
    layers: LayerSpec = "auto",
    free_grads_at_batch_start: bool | None = None,
    accelerator: str = "cpu",
) -> int:
    """The peak tensor bytes of step ``step`` (default: the first with optimizer state, as trials meter) of a fit
    of ``model`` in place under ``policy``; ``data`` is a data module, a DataLoader or a list of batches (counted)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    callback = RecomputeCallback(
        policy, layers=layers, memory_steps=range(step + 1), free_grads_at_batch_start=free_grads_at_batch_start
    )
    trainer = L.Trainer(accelerator=accelerator, devices=1, max_steps=step + 1, callbacks=[callback], **QUIET_TRAINER)
    if isinstance(data, L.LightningDataModule):
        trainer.fit(model, datamodule=data)
    else:  # a list of batches is a map-style dataset
        loader = data if isinstance(data, DataLoader) else DataLoader(cast(Dataset[Any], data), batch_size=None)
        trainer.fit(model, train_dataloaders=loader)
    peaks = [r.peak_bytes for r in callback.records if r.step == step and r.peak_bytes is not None]
    if not peaks:
        raise RuntimeError(f"the fit stopped after {trainer.global_step} steps, before step {step} was measured")
    return max(peaks)


def _compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` or one of its modules runs through torch.compile (a policy's ``compile: true`` aside:
    its `CompiledCall` runs eagerly while the ledger is on)."""
    if getattr(model, "_compiler_ctx", None) is not None:  # Lightning unwrapped a torch.compile(model) given to fit
        return True
    from torch._dynamo.eval_frame import OptimizedModule

    return any(
        isinstance(m, OptimizedModule)
        or not isinstance(getattr(m, "_compiled_call_impl", None), (type(None), CompiledCall))
        for m in model.modules()
    )


def _batch_size(batch: Any) -> int | None:
    try:
        return int(extract_batch_size(batch))
    except (MisconfigurationException, RecursionError):  # what Lightning raises for tensor-free or cyclic batches
        return None


def _tokens(batch: Any) -> int | None:
    """Tokens in a batch: the first integer tensor shaped (batch, seq, ...) holds token ids."""
    for value in tree_flatten(batch)[0]:
        integral = isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex())
        if integral and value.ndim >= 2 and value.dtype is not torch.bool:
            return int(value.shape[0] * value.shape[1])
    return None
