"""Which policies a training job races: the planner's, from a profile of the job's own first batch.

The profile leaves the job exactly as it was: parameters, buffers, gradients, random generators, the job's
optimizer (the profile steps a fresh one like it) and its logged metrics.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch import nn

from lightning_recompute import RecomputePolicy
from lightning_recompute.errors import RecomputeError
from lightning_recompute.layers import LayerSpec, layer_names
from lightning_recompute.modes import MODES
from lightning_recompute.planner import Planner
from lightning_recompute.policy import PolicyLike
from lightning_recompute.profile import Profile, profile_model
from lightning_recompute.sources import as_policy

__all__ = [
    "PROFILED_STRATEGIES",
    "Candidate",
    "baseline_candidates",
    "find_candidates",
    "given_candidates",
    "planner_candidates",
    "profile_in_job",
    "shared_candidates",
]

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

    def to_dict(self) -> dict[str, Any]:
        """Plain types (what rank 0 sends the other ranks)."""
        return {
            "policy": self.policy.to_dict(),
            "short": self.short,
            "label": self.label,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_step_time_s": self.predicted_step_time_s,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Candidate:
        return cls(
            RecomputePolicy.from_dict(data["policy"]),
            str(data["short"]),
            str(data["label"]),
            predicted_peak_bytes=data.get("predicted_peak_bytes"),
            predicted_step_time_s=data.get("predicted_step_time_s"),
        )


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
    pick = fitting[-1]  # the front is by increasing peak and decreasing time: the fastest that fits
    n = len(fitting)
    count = max(1, min(most, n))
    # Evenly over the fitting front, both ends included: the safest and the pick.
    chosen = [n - 1] if count == 1 else sorted({round(i * (n - 1) / (count - 1)) for i in range(count)})
    out = []
    for j, i in enumerate(chosen):
        planned = fitting[i]
        label = "planner:budget" if planned is pick else f"planner:front{j + 1}"
        out.append(Candidate(planned.policy, planned.short(), label, planned.peak_bytes, planned.step_time_s))
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


def baseline_candidates(model: nn.Module, layers: LayerSpec, modes: Sequence[str]) -> list[Candidate]:
    """Every mode of ``modes`` on every layer, the one saving most memory first (no prediction)."""
    names = layer_names(model, layers)
    saving = {s.name: s.saving for s in MODES}
    ordered = sorted(dict.fromkeys(modes), key=lambda m: -saving.get(m, 0))
    out = []
    for mode in ordered:
        policy = RecomputePolicy.uniform(mode)
        out.append(Candidate(policy, policy.short(names), f"baseline:{mode}"))
    return out


def given_candidates(model: nn.Module, layers: LayerSpec, policies: Iterable[PolicyLike]) -> list[Candidate]:
    """The user's own candidates, in the order given (put the safest first)."""
    names = layer_names(model, layers)
    out: list[Candidate] = []
    seen: set[str] = set()
    for i, given in enumerate(policies):
        policy = as_policy(given)
        if policy.fingerprint() in seen:
            continue
        seen.add(policy.fingerprint())
        out.append(Candidate(policy, policy.short(names), f"given:{i}"))
    return out


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
    """`profile_model` of the job's model on ``batch``, leaving the job exactly as it was."""
    optimizer = trainer.optimizers[0] if trainer.optimizers else None

    def fresh(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        if optimizer is None:
            return torch.optim.AdamW(params)
        # `defaults` can hold keys the constructor refuses (AdamW's decoupled_weight_decay).
        accepted = inspect.signature(type(optimizer)).parameters
        return type(optimizer)(params, **{k: v for k, v in optimizer.defaults.items() if k in accepted})

    with _job_untouched(pl_module):
        return profile_model(
            pl_module,
            batch,
            layers,
            modes=list(modes),
            optimizer=fresh,
            repeats=repeats,
            free_grads_at_batch_start=free_grads_at_batch_start,
        )


def find_candidates(
    trainer: L.Trainer,
    pl_module: L.LightningModule,
    batch: Any,
    *,
    given: Sequence[RecomputePolicy] | None,
    layers: LayerSpec,
    modes: Sequence[str],
    limit_bytes: int,
    max_candidates: int,
    free_grads_at_batch_start: bool,
    repeats: int,
) -> tuple[list[Candidate], list[str]]:
    """What the job races, safest first, and notes: the ``given`` policies; else the planner's; the uniform
    policies of ``modes`` where the model is sharded or the profile fails.
    """
    if given is not None:
        return given_candidates(pl_module, layers, given), []
    strategy = type(trainer.strategy).__name__
    if strategy not in PROFILED_STRATEGIES:
        note = f"{strategy}: the model is sharded, so it is not profiled in the job; racing uniform policies"
        return baseline_candidates(pl_module, layers, modes), [note]
    try:
        profile = profile_in_job(
            trainer,
            pl_module,
            batch,
            layers=layers,
            modes=modes,
            free_grads_at_batch_start=free_grads_at_batch_start,
            repeats=repeats,
        )
        found, planner_note = planner_candidates(profile, limit_bytes, modes, max_candidates)
    except (RecomputeError, torch.OutOfMemoryError) as err:
        failed = f"profiling the first batch failed ({type(err).__name__}: {err}); racing uniform policies"
        return baseline_candidates(pl_module, layers, modes), [failed]
    notes = [
        f"the first batch does not fit with every layer in {m}: that mode was profiled in {k} steps, each with a "
        f"group of layers in it and the rest full"
        for m, k in profile.split.items()
    ]
    return found, [*notes, planner_note] if planner_note else notes


def shared_candidates(
    trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, **find: Any
) -> tuple[list[Candidate], list[str]]:
    """`find_candidates` on rank 0, received by every rank; a failure on rank 0 reaches every rank as a
    `RecomputeError` (on one rank the original error is raised).
    """
    payload: dict[str, Any] | None = None
    if trainer.is_global_zero:
        try:
            found, notes = find_candidates(trainer, pl_module, batch, **find)
            payload = {"candidates": [c.to_dict() for c in found], "notes": notes}
        except Exception as err:  # sent to every rank and raised there
            payload = {"error": f"{type(err).__name__}: {err}"}
            if trainer.world_size == 1:
                raise
    payload = trainer.strategy.broadcast(payload, src=0)
    assert payload is not None
    if "error" in payload:
        raise RecomputeError(f"AutoRecompute: finding candidates on rank 0 failed: {payload['error']}")
    return [Candidate.from_dict(d) for d in payload["candidates"]], list(payload["notes"])


@contextmanager
def _job_untouched(pl_module: L.LightningModule) -> Iterator[None]:
    """Random number generators, gradients and logging as they were, whatever runs inside."""
    params = list(pl_module.parameters())
    grads = [p.grad for p in params]
    devices = [pl_module.device] if pl_module.device.type == "cuda" else []

    def silent(*args: Any, **kwargs: Any) -> None:
        return None

    # Instance attributes shadow the methods: profile steps must not log into the job's metrics.
    pl_module.__dict__["log"] = silent
    pl_module.__dict__["log_dict"] = silent
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        pl_module.__dict__.pop("log", None)
        pl_module.__dict__.pop("log_dict", None)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
