"""`AutoRecompute`: tune the recompute policy inside the training job, on its first steps.

Every tuning step is a training step; see docs/AUTO.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_recompute import RecomputeCallback, RecomputePolicy, StepRecord
from lightning_recompute.auto.candidates import Candidate, shared_candidates
from lightning_recompute.auto.record import JobTuning, record_decision
from lightning_recompute.auto.retry import StepRetry
from lightning_recompute.errors import RecomputeError
from lightning_recompute.layers import LayerSpec
from lightning_recompute.meter import cpu_memory_limit
from lightning_recompute.modes import Mode
from lightning_recompute.policy import PolicyLike
from lightning_recompute.race import RacePlan, RaceResult
from lightning_recompute.race.machine import machine_state
from lightning_recompute.race.schedule import RaceSchedule, RoundReport, Turn
from lightning_recompute.sources import as_policy
from lightning_recompute.units import format_bytes, parse_bytes

__all__ = ["AUTO_PLAN", "AutoDecision", "AutoRecompute", "agree_across_ranks"]


AUTO_PLAN = RacePlan(steps=2, min_rounds=6, max_rounds=24, time_s=600.0, estimate_rounds=6, warmup_steps=1)
"""The race a job runs by default: shorter than ``recompute-tune``'s, since slower candidates cost the job time."""


@dataclasses.dataclass(frozen=True)
class AutoDecision:
    """What the job settled on, kept in the callback's checkpoint state."""

    policy: RecomputePolicy
    short: str
    label: str
    """Where the policy came from (`Candidate.label`)."""
    summary: str
    """The decision in words, as logged."""

    def to_dict(self) -> dict[str, Any]:
        """Plain types (the checkpoint's form)."""
        return {"policy": self.policy.to_dict(), "short": self.short, "label": self.label, "summary": self.summary}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AutoDecision:
        return cls(
            RecomputePolicy.from_dict(data["policy"]), str(data["short"]), str(data["label"]), str(data["summary"])
        )


@dataclasses.dataclass
class _StepTotals:
    """One optimizer step's measurements, summed over its micro-batches."""

    global_step: int = -1
    seconds: float = 0.0
    peak_bytes: int | None = None
    samples: int = 0
    tokens: int | None = None

    def add(self, record: StepRecord) -> None:
        self.seconds += record.seconds
        if record.peak_bytes is not None:
            self.peak_bytes = max(self.peak_bytes or 0, record.peak_bytes)
        self.samples += record.samples
        if record.tokens is not None:
            self.tokens = (self.tokens or 0) + record.tokens


class AutoRecompute(RecomputeCallback):
    """Find the fastest recompute policy that fits ``budget`` inside the training job, then train with it.

    At the first batch the planner's candidates that fit the limit race, one per optimizer step, and the
    winner trains the rest of the job (see docs/AUTO.md).

    Args:
        budget: the device memory a step may use: bytes or a size (``"40GiB"``).
        margin: the fraction of ``budget`` kept free; the limit is ``budget * (1 - margin)``.
        output: where to write the chosen policy (with ``tuned_for``); ``None``: nowhere.
        tracking_uri: MLflow tracking URI of the record; ``None``: the job's ``MLFlowLogger``'s, if any.
        experiment: MLflow experiment of the record (default: the logger's, else ``auto-recompute``).
        candidates: race these policies (safest first) instead of the planner's.
        max_candidates: how many of the planner's candidates race (at least 2).
        modes: the modes the planner combines per layer.
        plan: the race (`RacePlan`; default `AUTO_PLAN`).
        layers: which modules are layers, as for `RecomputeCallback`.
        catch_oom: on an out-of-memory step, drop the candidate and run the batch again under the safest
            one left. ``None``: on for one CUDA device or the capped CPU, without gradient accumulation.
        profile_repeats: timed steps per mode in the profile.
        name: the session's name in MLflow (default ``auto-<model class>``).
        free_grads_at_batch_start: as for `RecomputeCallback`.

    Raises:
        RecomputeError: a bad argument (named, with what is valid).
    """

    def __init__(
        self,
        budget: int | str,
        *,
        margin: float = 0.05,
        output: str | Path | None = None,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        candidates: Sequence[PolicyLike] | None = None,
        max_candidates: int = 4,
        modes: Sequence[str] = (Mode.NONE.value, Mode.SELECTIVE.value, Mode.FULL.value),
        plan: RacePlan | None = None,
        layers: LayerSpec = "auto",
        catch_oom: bool | None = None,
        profile_repeats: int = 3,
        name: str | None = None,
        free_grads_at_batch_start: bool | None = None,
    ) -> None:
        # Until the first batch, the policy that needs least memory without knowing the model.
        super().__init__(
            RecomputePolicy.uniform(Mode.FULL.value),
            layers=layers,
            memory_steps=frozenset(),
            free_grads_at_batch_start=free_grads_at_batch_start,
        )
        try:
            self.budget_bytes = parse_bytes(budget)
        except (TypeError, ValueError) as err:
            raise RecomputeError(f"AutoRecompute budget: {err}") from err
        if not 0.0 <= margin < 1.0:
            raise RecomputeError(f"AutoRecompute margin: must be in [0, 1), got {margin!r}")
        if not isinstance(max_candidates, int) or max_candidates < 2:
            raise RecomputeError(f"AutoRecompute max_candidates: must be an integer >= 2, got {max_candidates!r}")
        if not isinstance(profile_repeats, int) or profile_repeats < 1:
            raise RecomputeError(f"AutoRecompute profile_repeats: must be a positive integer, got {profile_repeats!r}")
        self.limit_bytes = int(self.budget_bytes * (1.0 - margin))
        self.output = None if output is None else Path(output)
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        # Read now: a bad policy is an error at construction, not on rank 0 alone at the first batch.
        self.given = [as_policy(c) for c in candidates] if candidates is not None else None
        if self.given is not None and not self.given:
            raise RecomputeError("AutoRecompute candidates: an empty list; give at least one policy, or None")
        self.max_candidates = max_candidates
        self.modes = tuple(modes)
        self.plan = plan or AUTO_PLAN
        self.catch_oom = catch_oom
        self.profile_repeats = profile_repeats
        self.name = name
        self.candidates: list[Candidate] = []
        self.notes: list[str] = []
        """What the tuning noticed (planner notes, a dropped candidate, an out-of-memory retry)."""
        self.schedule: RaceSchedule | None = None
        self.decision: AutoDecision | None = None
        self.race_result: RaceResult | None = None
        self.tuning_steps = 0
        self.record_run_id: str | None = None
        self._turn: Turn | None = None
        self._totals = _StepTotals()
        self._retry: StepRetry | None = None
        self._retry_step = -1
        self._oom: str | None = None
        self._began = 0.0
        self._machine_before: dict[str, Any] = {}
        self._world = 1
        self._on_cuda = False

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._world = int(trainer.world_size)
        self._on_cuda = pl_module.device.type == "cuda"
        accumulating = int(trainer.accumulate_grad_batches) > 1
        if self.catch_oom is None:
            self.catch_oom = (self._on_cuda or cpu_memory_limit() is not None) and self._world == 1 and not accumulating
        elif self.catch_oom and self._world > 1:
            raise RecomputeError(
                "AutoRecompute catch_oom=True: not with several ranks (a rank retrying while the others wait in a "
                "collective would hang the job); leave it None or False"
            )
        elif self.catch_oom and accumulating:
            raise RecomputeError(
                f"AutoRecompute catch_oom=True: not with gradient accumulation (accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches}): a step cannot be run again from its last micro-batch alone; "
                f"leave it None or False"
            )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.decision is not None:  # restored from a checkpoint: no tuning again
            self.switch_policy(pl_module, self.decision.policy)
            self._after_tuning()
            rank_zero_info(f"AutoRecompute: resuming with the policy decided before: {self.decision.summary}")

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.decision is None:
            if self.schedule is None:
                self._start(trainer, pl_module, batch)
            if self._retry is not None and self._turn is not None and trainer.global_step != self._retry_step:
                self._retry.mark(pl_module)
                self._retry_step = trainer.global_step
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.decision is not None or self.schedule is None or self._turn is None:
            return
        turn = self._turn
        if self._oom is not None:
            self._oom = None
            self._totals = _StepTotals(trainer.global_step)
            self._advance(trainer, pl_module)
            return
        record = self.records[-1]
        expected = self.schedule.entrants[turn.key].policy.fingerprint()
        if record.policy != expected:
            raise RuntimeError(f"AutoRecompute: step {record.step} ran policy {record.policy}, its turn was {expected}")
        step = self._totals
        step.add(record)
        if trainer.global_step == step.global_step:
            return  # gradient accumulation: the optimizer step is not over; switch only between steps
        self.tuning_steps += 1
        self.schedule.record(turn, step.seconds, step.peak_bytes, tokens=step.tokens, samples=step.samples or None)
        self._advance(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.decision is None and self.schedule is not None:
            self.schedule.finish("the job ended")
            self._settle(trainer, pl_module)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._stop_retrying()
        super().teardown(trainer, pl_module, stage)

    def _start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any) -> None:
        self._began = time.perf_counter()
        self._machine_before = machine_state(pl_module.device.type)
        self.candidates, notes = shared_candidates(
            trainer,
            pl_module,
            batch,
            given=self.given,
            layers=self.layers,
            modes=self.modes,
            limit_bytes=self.limit_bytes,
            max_candidates=self.max_candidates,
            free_grads_at_batch_start=self.grad_freeing is not None and self.grad_freeing.enabled,
            repeats=self.profile_repeats,
        )
        self.notes.extend(notes)
        for note in self.notes:
            rank_zero_info(f"AutoRecompute: {note}")
        lines = [
            f"  {c.short}  {c.label}"
            + (f"  predicted peak {format_bytes(c.predicted_peak_bytes)}" if c.predicted_peak_bytes else "")
            for c in self.candidates
        ]
        rank_zero_info(
            f"AutoRecompute: racing {len(self.candidates)} candidate(s) under the limit "
            f"{format_bytes(self.limit_bytes)}, one per optimizer step, safest first:\n" + "\n".join(lines)
        )
        self.schedule = RaceSchedule(
            [(c.key, c.policy, c.short) for c in self.candidates],
            references=[self.candidates[0].key],
            plan=self.plan,
            budget_bytes=self.limit_bytes,
            # A capped CPU runs out of memory only in metered steps (lightning_recompute.meter).
            meter_every_step=self._on_cuda or cpu_memory_limit() is not None,
            agree=agree_across_ranks if self._world > 1 else None,
        )
        if self.catch_oom:
            self._retry = StepRetry(lambda err: self._after_oom(pl_module, err))
            self._retry.install(pl_module)
        self._advance(trainer, pl_module)

    def _advance(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert self.schedule is not None
        turn = self.schedule.next_turn()
        self._turn = turn
        if turn is None:
            self._settle(trainer, pl_module)
            return
        if turn.key != self.policy.fingerprint():
            self.switch_policy(pl_module, self.schedule.entrants[turn.key].policy)
        self.memory_steps = frozenset({trainer.global_step}) if turn.metered else frozenset()
        self._totals = _StepTotals(trainer.global_step)

    def _settle(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Switch to the race's winner for the rest of training, say so, and record it."""
        assert self.schedule is not None
        schedule = self.schedule
        by_key = {c.key: c for c in self.candidates}
        winner = schedule.winner
        if winner is None or schedule.entrants[winner].out is not None:
            # Nothing raced to a decision (every candidate out): train on the least measured peak.
            peaks = {k: e.peak_bytes for k, e in schedule.entrants.items() if e.peak_bytes is not None}
            winner = min(peaks, key=peaks.__getitem__) if peaks else self.candidates[0].key
            self.notes.append(f"no candidate stayed within the limit; training on the least peak measured ({winner})")
        chosen = by_key[trainer.strategy.broadcast(winner, src=0)]
        result = RaceResult.from_worker(
            {
                **schedule.result(),
                "wall_s": time.perf_counter() - self._began,
                "machine_before": self._machine_before,
                "machine_after": machine_state(pl_module.device.type),
            },
            {c.key: (c.label,) for c in self.candidates},
            {c.key: c.policy.to_dict() for c in self.candidates},
        )
        self.race_result = result
        words = [f"settled on {chosen.short} ({chosen.label}) after {self.tuning_steps} tuning steps"]
        if result.ok and result.stop:
            words.append(f"{result.select_rounds} selection rounds: {result.stop}")
        words += [*result.decision_lines(), *result.headlines()]
        words += [f"out: {e.short}: {e.out}" for e in result.entrants.values() if e.out]
        summary = "; ".join(words)
        self.decision = AutoDecision(chosen.policy, chosen.short, chosen.label, summary)
        self.switch_policy(pl_module, chosen.policy)
        self._after_tuning()
        self._stop_retrying()
        rank_zero_info(f"AutoRecompute: {summary}")
        if trainer.is_global_zero:
            tuning = JobTuning(
                policy=chosen.policy,
                summary=summary,
                candidates=tuple(self.candidates),
                race=result,
                notes=tuple(self.notes),
                budget_bytes=self.budget_bytes,
                limit_bytes=self.limit_bytes,
                modes=self.modes,
                plan=self.plan,
                layers=self.layers,
                micro_batch=self.records[-1].samples if self.records else None,
                name=self.name or f"auto-{type(pl_module).__name__}",
                output=self.output,
                tracking_uri=self.tracking_uri,
                experiment=self.experiment,
            )
            self.record_run_id = record_decision(tuning, trainer, pl_module)

    def _stop_retrying(self) -> None:
        if self._retry is not None:
            self._retry.remove()
            self._retry = None

    def _after_tuning(self) -> None:
        self._turn = None
        # CUDA's allocator statistics are free; the CPU ledger costs a Python call per op, so it stays off.
        self.memory_steps = None if self._on_cuda else frozenset()

    def _after_oom(self, pl_module: L.LightningModule, err: BaseException) -> bool:
        """Drop the candidate that ran out of memory and put on the safest left; ``False``: none left."""
        schedule, turn = self.schedule, self._turn
        if schedule is None or turn is None or self.decision is not None:
            return False
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        schedule.knock_out(turn.key, f"out of memory: {first_line[:200]}")
        left = schedule.alive()
        if not left:
            return False
        safest = left[0]
        note = (
            f"{schedule.entrants[turn.key].short} ran out of memory in a step; it is out, and the same batch ran "
            f"again from the same random state under {schedule.entrants[safest].short}"
        )
        self.notes.append(note)
        rank_zero_warn(f"AutoRecompute: {note}")
        self.switch_policy(pl_module, schedule.entrants[safest].policy, retry=True)
        self._oom = note
        return True

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["auto_decision"] = None if self.decision is None else self.decision.to_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        decided = state_dict.get("auto_decision")
        if decided is not None:
            self.decision = AutoDecision.from_dict(decided)
        else:
            rank_zero_info("AutoRecompute: the checkpoint was written before a decision; tuning starts again")


def agree_across_ranks(report: RoundReport) -> RoundReport:
    """Rank 0's times and clock and the largest peak any rank measured, agreed at a round's end.

    One ``all_gather_object``: every rank must call it at the same round.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return report
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dataclasses.asdict(report))
    peaks: dict[str, int | None] = {}
    for g in gathered:
        for k, v in g["peaks"].items():
            if v is not None:
                peaks[k] = max(peaks.get(k) or 0, int(v))
            else:
                peaks.setdefault(k, None)
    first = gathered[0]
    return RoundReport(times=dict(first["times"]), peaks=peaks, elapsed_s=float(first["elapsed_s"]))
