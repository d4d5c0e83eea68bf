"""`AutoRecompute`: tune the recompute policy inside the training job, on its first steps, racing the planner's
candidates from a profile of the job's own first batch that leaves the job as it was (docs/AUTO.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import logging
from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_recompute import RecomputePolicy
from lightning_recompute.errors import RecomputeError
from lightning_recompute.layers import LayerSpec, layer_names
from lightning_recompute.meter import cpu_memory_limit
from lightning_recompute.modes import MODES, Mode
from lightning_recompute.planner import Planner
from lightning_recompute.policy import PolicyLike
from lightning_recompute.profile import Profile, profile_model
from lightning_recompute.race import RacePlan, RaceResult
from lightning_recompute.race.schedule import RaceCallback, RaceSchedule, RoundReport
from lightning_recompute.sources import as_policy
from lightning_recompute.tuned_for import TunedFor
from lightning_recompute.units import format_bytes, parse_bytes

__all__ = ["AUTO_PLAN", "AutoDecision", "AutoRecompute", "Candidate", "agree_across_ranks"]

_log = logging.getLogger(__name__)


AUTO_PLAN = RacePlan(steps=2, min_rounds=6, max_rounds=24, time_s=600.0, estimate_rounds=6, warmup_steps=1)
"""The race a job runs by default: shorter than ``recompute-tune``'s, since slower candidates cost the job time."""


PROFILED_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy")
"""Where the first batch is profiled in the job: a sharded model gathers its parameters collectively, so it cannot."""


@dataclasses.dataclass(frozen=True)
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
    """Up to ``most`` points of the planner's front that fit ``limit_bytes`` (the pick and the safest always),
    safest first, topped up with fitting uniform policies; or, when none fits, the least-peak one and a note."""
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


@dataclasses.dataclass(frozen=True)
class AutoDecision:
    """What the job settled on and why (as logged), kept in the callback's checkpoint state."""

    policy: RecomputePolicy
    short: str
    label: str
    summary: str

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.to_dict(), "short": self.short, "label": self.label, "summary": self.summary}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AutoDecision:
        return cls(
            RecomputePolicy.from_dict(data["policy"]), str(data["short"]), str(data["label"]), str(data["summary"])
        )


class AutoRecompute(RaceCallback):
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
        # Read now: a bad policy is an error at construction, not on rank 0 alone at the first batch.
        self.given = None if candidates is None else [as_policy(c) for c in candidates]
        if self.given == []:
            raise RecomputeError("AutoRecompute candidates: an empty list; give at least one policy, or None")
        self.limit_bytes = int(self.budget_bytes * (1.0 - margin))
        self.output = None if output is None else Path(output)
        self.tracking_uri, self.experiment, self.name = tracking_uri, experiment, name
        self.max_candidates, self.modes, self.plan = max_candidates, tuple(modes), plan or AUTO_PLAN
        self.catch_oom, self.profile_repeats = catch_oom, profile_repeats
        self.candidates: list[Candidate] = []
        self.notes: list[str] = []
        """What the tuning noticed (planner notes, a dropped candidate, an out-of-memory retry)."""
        self.decision: AutoDecision | None = None
        self.race_result: RaceResult | None = None
        self.record_run_id: str | None = None
        self._rewind: Callable[[], None] | None = None
        """Sets the random generators and buffers back to the step's start (with ``catch_oom``)."""
        self._guarded: Callable[..., Any] | None = None

    @property
    def summary(self) -> str:
        """The decision in words, as logged (empty before it)."""
        return "" if self.decision is None else self.decision.summary

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        refused = None
        if int(trainer.world_size) > 1:
            refused = "several ranks (a rank retrying while the others wait in a collective would hang the job)"
        elif int(trainer.accumulate_grad_batches) > 1:
            refused = (
                f"gradient accumulation (accumulate_grad_batches={trainer.accumulate_grad_batches}): a step cannot "
                f"be run again from its last micro-batch alone"
            )
        if self.catch_oom is None:
            self.catch_oom = _meters_every_step(pl_module) and refused is None
        elif self.catch_oom and refused:
            raise RecomputeError(f"AutoRecompute catch_oom=True: not with {refused}; leave it None or False")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.decision is not None:  # restored from a checkpoint: no tuning again
            self.switch_policy(pl_module, self.decision.policy)
            self._after_tuning(pl_module)
            rank_zero_info(f"AutoRecompute: resuming with the policy decided before: {self.decision.summary}")

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.decision is None:
            if self.schedule is None:
                self._start(trainer, pl_module, batch)
            if self.catch_oom and self.decision is None:  # (catch_oom refuses gradient accumulation)
                self._rewind = _step_start(pl_module)
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.decision is None and self.schedule is not None:
            self.schedule.finish("the job ended")
            self._over(trainer, pl_module)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._stop_retrying(pl_module)
        super().teardown(trainer, pl_module, stage)

    def _start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any) -> None:
        # Found on rank 0 and sent to every rank; a failure there reaches every rank (on one rank: raised as is).
        payload: tuple[list[Candidate], list[str]] | str | None = None
        if trainer.is_global_zero:
            try:
                payload = self._find_candidates(trainer, pl_module, batch)
            except Exception as err:  # sent to every rank and raised there
                if trainer.world_size == 1:
                    raise
                payload = f"{type(err).__name__}: {err}"
        payload = trainer.strategy.broadcast(payload, src=0)
        if not isinstance(payload, tuple):
            raise RecomputeError(f"AutoRecompute: finding candidates on rank 0 failed: {payload}")
        self.candidates = payload[0]
        self.notes.extend(payload[1])
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
            meter_every_step=_meters_every_step(pl_module),
            agree=agree_across_ranks if trainer.world_size > 1 else None,
            device=pl_module.device.type,
        )
        if self.catch_oom:
            self._install_retry(pl_module)
        self._advance(trainer, pl_module)

    def _find_candidates(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any
    ) -> tuple[list[Candidate], list[str]]:
        """What the job races, safest first, and notes: the given policies; else the planner's; the uniform
        policies of ``modes`` where the model is sharded or the profile fails."""
        names = layer_names(pl_module, self.layers)
        if self.given is not None:
            given: dict[str, Candidate] = {}
            for i, p in enumerate(self.given):
                given.setdefault(p.fingerprint(), Candidate(p, p.short(names), f"given:{i}"))
            return list(given.values()), []
        saving = {s.name: s.saving for s in MODES}
        uniform = {
            m: RecomputePolicy.uniform(m) for m in sorted(dict.fromkeys(self.modes), key=lambda m: -saving.get(m, 0))
        }
        baselines = [Candidate(p, p.short(names), f"baseline:{m}") for m, p in uniform.items()]
        strategy = type(trainer.strategy).__name__
        if strategy not in PROFILED_STRATEGIES:
            return baselines, [
                f"{strategy}: the model is sharded, so it is not profiled in the job; racing uniform policies"
            ]
        freeing = self.grad_freeing is not None and self.grad_freeing.enabled
        try:
            profile = profile_in_job(
                trainer,
                pl_module,
                batch,
                layers=self.layers,
                modes=self.modes,
                free_grads_at_batch_start=freeing,
                repeats=self.profile_repeats,
            )
            found, note = planner_candidates(profile, self.limit_bytes, self.modes, self.max_candidates)
        except (RecomputeError, torch.OutOfMemoryError) as err:
            return baselines, [
                f"profiling the first batch failed ({type(err).__name__}: {err}); racing uniform policies"
            ]
        notes = [
            f"the first batch does not fit with every layer in {m}: that mode was profiled in {k} steps, each with a "
            f"group of layers in it and the rest full"
            for m, k in profile.split.items()
        ]
        return found, [*notes, note] if note else notes

    def _over(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Switch to the race's winner for the rest of training, say so, and record it."""
        assert self.schedule is not None
        schedule, winner = self.schedule, self.schedule.winner
        if winner is None or schedule.entrants[winner].out is not None:
            # Nothing raced to a decision (every candidate out): train on the least measured peak.
            peaks = {k: e.peak_bytes for k, e in schedule.entrants.items() if e.peak_bytes is not None}
            winner = min(peaks, key=peaks.__getitem__) if peaks else self.candidates[0].key
            self.notes.append(f"no candidate stayed within the limit; training on the least peak measured ({winner})")
        chosen = {c.key: c for c in self.candidates}[trainer.strategy.broadcast(winner, src=0)]
        self.race_result = result = schedule.result({c.key: (c.label,) for c in self.candidates})
        words = [f"settled on {chosen.short} ({chosen.label}) after {self.tuning_steps} tuning steps"]
        if result.ok and result.stop:
            words.append(f"{result.select_rounds} selection rounds: {result.stop}")
        words += [*result.decision_lines(), *result.headlines()]
        words += [f"out: {e.short}: {e.out}" for e in result.entrants.values() if e.out]
        self.decision = AutoDecision(chosen.policy, chosen.short, chosen.label, "; ".join(words))
        self.switch_policy(pl_module, chosen.policy)
        self._after_tuning(pl_module)
        rank_zero_info(f"AutoRecompute: {self.decision.summary}")
        if trainer.is_global_zero:
            _record_decision(self, result, trainer, pl_module)

    def _after_tuning(self, pl_module: L.LightningModule) -> None:
        self.turn = None
        self._stop_retrying(pl_module)
        # CUDA's allocator statistics are free; the CPU ledger costs a Python call per op, so it stays off.
        self.memory_steps = None if pl_module.device.type == "cuda" else frozenset()

    def _install_retry(self, pl_module: L.LightningModule) -> None:
        """Wrap the module's ``optimizer_step`` (Lightning has no hook that may retry a step) so that a step whose
        closure runs out of memory runs again from its start under the safest candidate left. An error in the
        optimizer's update, after the closure, is not retried (some parameters may be updated already)."""
        original = pl_module.optimizer_step

        def guarded(epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> Any:
            ran: list[bool] = []

            def closure() -> Any:
                out = optimizer_closure()
                ran.append(True)
                return out

            try:
                return original(epoch, batch_idx, optimizer, closure if optimizer_closure is not None else None)
            except torch.OutOfMemoryError as err:
                if ran or self._rewind is None or not self._after_oom(pl_module, err):
                    raise
            # Out of the except block, whose traceback holds the failed step's activations.
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._rewind()
            return original(epoch, batch_idx, optimizer, optimizer_closure)

        pl_module.__dict__["optimizer_step"] = self._guarded = guarded

    def _stop_retrying(self, pl_module: L.LightningModule) -> None:
        if self._guarded is not None and pl_module.__dict__.get("optimizer_step") is self._guarded:
            del pl_module.__dict__["optimizer_step"]
        self._guarded = None
        self._rewind = None  # the saved step start holds a copy of every buffer: not kept past tuning

    def _after_oom(self, pl_module: L.LightningModule, err: BaseException) -> bool:
        """Drop the candidate that ran out of memory and put on the safest left; ``False``: none left."""
        schedule, turn = self.schedule, self.turn
        assert schedule is not None and turn is not None  # the retry is installed while the race runs
        first_line = (str(err).strip() or type(err).__name__).splitlines()[0]
        schedule.knock_out(turn.key, f"out of memory: {first_line[:200]}")
        if not schedule.alive():
            return False
        safest = schedule.entrants[schedule.alive()[0]]
        note = (
            f"{schedule.entrants[turn.key].short} ran out of memory in a step; it is out, and the same batch ran "
            f"again from the same random state under {safest.short}"
        )
        self.notes.append(note)
        rank_zero_warn(f"AutoRecompute: {note}")
        self.switch_policy(pl_module, safest.policy, retry=True)
        self._retried = True
        return True

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "auto_decision": None if self.decision is None else self.decision.to_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("auto_decision") is not None:
            self.decision = AutoDecision.from_dict(state_dict["auto_decision"])
        else:
            rank_zero_info("AutoRecompute: the checkpoint was written before a decision; tuning starts again")


def _meters_every_step(pl_module: L.LightningModule) -> bool:
    """On CUDA, where it is free, and on the capped CPU, which runs out of memory only in metered steps."""
    return pl_module.device.type == "cuda" or cpu_memory_limit() is not None


def _step_start(module: L.LightningModule) -> Callable[[], None]:
    """What sets back what a step changes besides parameters: the random generators and the buffers."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(module.device) if module.device.type == "cuda" else None
    buffers = [(b, b.detach().clone()) for b in module.buffers()]

    def rewind() -> None:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, module.device)
        with torch.no_grad():
            for live, before in buffers:
                live.copy_(before)

    return rewind


def agree_across_ranks(report: RoundReport) -> RoundReport:
    """Rank 0's times and clock and the largest peak any rank measured (one ``all_gather_object``: every rank
    calls it at the same round's end)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    peaks = {k: max((p for g in gathered if (p := g.peaks.get(k)) is not None), default=None) for k in report.peaks}
    return dataclasses.replace(gathered[0], peaks=peaks)


def _record_decision(auto: AutoRecompute, race: RaceResult, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    """Write the policy file (when asked) and the MLflow record (when there is a store); its run's id in `auto`."""
    assert auto.decision is not None
    device = torch.cuda.get_device_name(pl_module.device) if pl_module.device.type == "cuda" else "cpu"
    micro_batch = auto.records[-1].samples if auto.records else None  # the last tuning step's
    policy = auto.decision.policy
    if auto.output is not None:
        peak = race.entrants[policy.fingerprint()].peak_bytes
        tuned = TunedFor(micro_batch, micro_batch, peak_bytes=peak, limit_bytes=auto.limit_bytes, device=device)
        try:
            policy.with_tuned_for(tuned).save(auto.output)
        except OSError as err:
            rank_zero_warn(f"AutoRecompute: could not write the policy file {auto.output}: {err}")
    loggers = [logger for logger in trainer.loggers if isinstance(logger, MLFlowLogger)]
    if auto.tracking_uri is not None:
        target: tuple[str, str, str | None] = auto.tracking_uri, auto.experiment or "auto-recompute", None
    elif loggers:
        experiment = auto.experiment or loggers[0].experiment.get_experiment(loggers[0].experiment_id).name
        target = loggers[0].experiment.tracking_uri, experiment, loggers[0].run_id
    else:
        return
    try:
        # The service's writer, through an entry point: the library imports neither it nor its dependencies.
        recorder: Any = None
        for entry in entry_points(group="lightning_recompute", name="mlflow_record"):
            with contextlib.suppress(ImportError):  # the entry point ships with the library, its dependencies not
                recorder = entry.load()
            break
        if recorder is None:
            rank_zero_warn(
                "AutoRecompute: the race is not recorded in MLflow: the record is written by the tuning service, "
                "install it with `pip install 'lightning-recompute[tune]'`"
            )
            return
        auto.record_run_id = recorder(auto, trainer, pl_module, race, device, target)
    except Exception as err:  # noqa: BLE001 - the record is a by-product; the job must train on
        _log.debug("AutoRecompute record failed", exc_info=True)
        rank_zero_warn(f"AutoRecompute: the MLflow record was not written ({type(err).__name__}: {err})")
