"""Which policies a training job races: the planner's, from a profile of the job's own first batch that leaves
the job as it was (docs/AUTO.md)."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch import nn

from lightning_recompute import RecomputePolicy
from lightning_recompute.layers import LayerSpec
from lightning_recompute.planner import Planner
from lightning_recompute.profile import Profile, profile_model

__all__ = ["PROFILED_STRATEGIES", "Candidate", "planner_candidates", "profile_in_job"]

PROFILED_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy")
"""Where the first batch is profiled in the job: one device, or rank 0 of DDP. A sharded model gathers
its parameters collectively, so those jobs race the uniform policies of ``modes``.
"""


@dataclass(frozen=True)
class Candidate:
    """A policy the job races, with where it came from and what the planner predicted for it."""

    policy: RecomputePolicy
    short: str
    label: str
    """Where it came from: ``planner:budget``, ``planner:front<i>``, ``baseline:<mode>`` or ``given:<i>``."""
    predicted_peak_bytes: int | None = None
    predicted_step_time_s: float | None = None

    @property
    def key(self) -> str:
        """The race's key for it: its fingerprint."""
        return self.policy.fingerprint()


def planner_candidates(
    profile: Profile, limit_bytes: int, modes: Sequence[str], most: int
) -> tuple[list[Candidate], str | None]:
    """Up to ``most`` points of the planner's front predicted to fit ``limit_bytes``, safest first
    (always the planner's pick and the safest), topped up with fitting uniform policies; and a note.

    When nothing is predicted to fit, the one policy of least predicted peak, with a note saying so.
    """
    planner = Planner(profile)
    front = planner.pareto_front(list(modes))  # by increasing peak
    fitting = [p for p in front if p.peak_bytes <= limit_bytes]
    note = None
    if not fitting:
        fitting = front[:1]
        note = (
            f"nothing the planner predicts fits the limit ({limit_bytes} bytes; least predicted peak "
            f"{front[0].peak_bytes} bytes); racing only the least-memory policy"
        )
    n = len(fitting)
    count = max(1, min(most, n))
    # Evenly over the fitting front, both ends included: the safest and the pick (the fastest that fits).
    chosen = [n - 1] if count == 1 else sorted({round(i * (n - 1) / (count - 1)) for i in range(count)})
    out = [
        Candidate(
            fitting[i].policy,
            fitting[i].short(),
            "planner:budget" if i == n - 1 else f"planner:front{j + 1}",
            fitting[i].peak_bytes,
            fitting[i].step_time_s,
        )
        for j, i in enumerate(chosen)
    ]
    if note is None and len(out) < most:
        # A noisy profile can collapse the front to one point: uniform policies predicted to fit race too.
        names = [lp.name for lp in profile.layers]
        taken = {c.key for c in out}
        uniform = {m: RecomputePolicy.from_modes(dict.fromkeys(names, m)) for m in dict.fromkeys(modes)}
        predicted = [(m, p, planner.predict(p)) for m, p in uniform.items() if p.fingerprint() not in taken]
        for mode, policy, guess in sorted(predicted, key=lambda mpg: mpg[2].peak_bytes):
            if len(out) < most and guess.peak_bytes <= limit_bytes:
                out.append(
                    Candidate(policy, policy.short(names), f"baseline:{mode}", guess.peak_bytes, guess.step_time_s)
                )
        out.sort(key=lambda c: c.predicted_peak_bytes or 0)  # safest first
    return out, note


def profile_in_job(
    trainer: L.Trainer,
    pl_module: L.LightningModule,
    batch: Any,
    *,
    layers: LayerSpec,
    modes: Sequence[str],
    free_grads_at_batch_start: bool,
    repeats: int,
) -> Profile:
    """`profile_model` of the job's model on ``batch``; random generators, gradients and logging as they were."""
    optimizer = trainer.optimizers[0] if trainer.optimizers else None

    def fresh(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        if optimizer is None:
            return torch.optim.AdamW(params)
        # `defaults` can hold keys the constructor refuses (AdamW's decoupled_weight_decay).
        accepted = inspect.signature(type(optimizer)).parameters
        return type(optimizer)(params, **{k: v for k, v in optimizer.defaults.items() if k in accepted})

    params = list(pl_module.parameters())
    grads = [p.grad for p in params]
    # Instance attributes shadow the methods: profile steps must not log into the job's metrics.
    pl_module.__dict__["log"] = pl_module.__dict__["log_dict"] = lambda *args, **kwargs: None
    try:
        with torch.random.fork_rng(devices=[pl_module.device] if pl_module.device.type == "cuda" else []):
            return profile_model(
                pl_module,
                batch,
                layers,
                modes=list(modes),
                optimizer=fresh,
                repeats=repeats,
                free_grads_at_batch_start=free_grads_at_batch_start,
            )
    finally:
        pl_module.__dict__.pop("log", None)
        pl_module.__dict__.pop("log_dict", None)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
