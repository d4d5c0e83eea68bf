"""The race's schedule (`RaceSchedule`: whose step is next, what the rounds decided), `RaceCallback` that feeds it a
fit's steps (for the service's `race` and for `AutoRecompute`), and `machine_state` (docs/TUNER.md, 'The race')."""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_recompute import QUIET_TRAINER, RecomputeCallback, RecomputePolicy
from lightning_recompute.race.result import RaceEntrant, RaceResult, Stop
from lightning_recompute.race.rule import RacePlan, Standing, stand, verdict
from lightning_recompute.race.stats import Interval, paired_ratio

ESTIMATE_SHARE = 0.4
"""Under a race budget (`RacePlan.total_s`), the share of it the estimation's rounds may take."""
MIN_ESTIMATE_ROUNDS = 8
"""Estimation rounds a race budget never cuts below: the fewest whose median's interval reaches 98%."""


@dataclass(frozen=True)
class Turn:
    """One training step of the race: whose, whether timed (not a settling step) and metered, in which phase
    (``warmup``, ``select`` or ``estimate``)."""

    key: str
    timed: bool
    metered: bool
    phase: str


@dataclass(frozen=True)
class RoundReport:
    """One process's round: each entrant's time (the median of its timed steps) and largest peak so far, and
    the seconds of selection by its clock."""

    times: dict[str, float]
    peaks: dict[str, int | None]
    elapsed_s: float


@dataclass
class _Entrant:
    key: str
    policy: RecomputePolicy
    short: str
    peak_bytes: int | None = None
    out: str | None = None
    dropped: str | None = None


class RaceSchedule:
    """The turns of a race and its decision: ``turn = next_turn()``, run a step under ``turn.key``'s policy,
    ``record(turn, seconds, peak)``, until `next_turn` returns ``None``; then `winner` and `result`.

    Args:
        entrants: ``(key, policy, short)`` per candidate, at least one; the first runs the warm-up.
        references: keys of the entrants the winner's "vs" figures are about.
        budget_bytes: an entrant whose metered peak exceeds it is out.
        meter_every_step: meter every step (CUDA, where it is free), not only first visits.
        clock: seconds, for the selection's time budget.
        agree: what several processes racing together take from each one's round (rank 0's times, the largest
            peak); with it an entrant over the limit is out at the round's end, so no rank skips a turn.
        device: whose state (`machine_state`) the result records.
    """

    def __init__(
        self,
        entrants: Sequence[tuple[str, RecomputePolicy, str]],
        references: Sequence[str] = (),
        plan: RacePlan | None = None,
        budget_bytes: int | None = None,
        *,
        meter_every_step: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        agree: Callable[[RoundReport], RoundReport] | None = None,
        device: str = "cpu",
    ) -> None:
        self.order = [k for k, _, _ in entrants]
        if not self.order or len(set(self.order)) != len(self.order):
            raise ValueError(f"a race needs at least one entrant, each with its own key: {self.order}")
        self.plan = plan or RacePlan()
        self.entrants = {k: _Entrant(k, p, s) for k, p, s in entrants}
        self.references = [k for k in references if k in self.entrants]
        self.budget, self.meter_every_step, self.clock, self.agree = budget_bytes, meter_every_step, clock, agree
        self.phase = "warmup"
        self.turns = deque(Turn(self.order[0], False, False, "warmup") for _ in range(self.plan.warmup_steps))
        self.round_times: dict[str, list[float]] = {}
        self.select_rounds: list[dict[str, float]] = []
        self.estimate_rounds: list[dict[str, float]] = []
        self.estimate_target = self.plan.estimate_rounds
        self.visited: set[str] = set()
        self.started: float | None = None
        self.elapsed_s = 0.0
        self.stop_reason = ""
        self.stopped: Stop | None = None
        self.standing: Standing | None = None
        self.winner: str | None = None
        self.tied: list[str] = []
        self.tokens: int | None = None
        self.samples: int | None = None
        self.over = False
        self.device, self.machine_before, self.began = device, machine_state(device), time.perf_counter()

    def next_turn(self) -> Turn | None:
        """The next step's turn, or ``None`` when the race is over (and stays over)."""
        while not self.turns:
            if self.over or not self._next_round():
                self.over = True
                return None
        return self.turns.popleft()

    def record(
        self,
        turn: Turn,
        seconds: float,
        peak_bytes: int | None,
        *,
        tokens: int | None = None,
        samples: int | None = None,
    ) -> None:
        """File the measurement of the step ``turn`` ran (its peak only when it was metered)."""
        if turn.phase == "warmup":
            return
        entrant = self.entrants[turn.key]
        if peak_bytes is not None:
            entrant.peak_bytes = max(entrant.peak_bytes or 0, peak_bytes)
            if self.agree is None:
                self._check_limit(entrant)
        if turn.timed and entrant.out is None:
            self.round_times.setdefault(turn.key, []).append(seconds)
            self.tokens, self.samples = tokens, samples

    def knock_out(self, key: str, reason: str) -> None:
        """Put ``key`` out of the race now (it failed, e.g. out of memory): it never runs again."""
        self.entrants[key].out = self.entrants[key].out or reason
        self.turns = deque(t for t in self.turns if t.key != key)
        self.round_times.pop(key, None)

    def _check_limit(self, entrant: _Entrant) -> None:
        peak = entrant.peak_bytes
        if self.budget is not None and peak is not None and peak > self.budget and entrant.out is None:
            self.knock_out(entrant.key, f"peaked at {peak} bytes in the race, over the limit {self.budget}")

    def finish(self, reason: str) -> None:
        """End the race now (the job ran out of steps) and decide on the rounds there are (the round in
        progress counts when every contender ran in it); the stop reason is ``"<reason> after <n> selection rounds"``.
        """
        if self.over:
            return
        if self.phase == "select" and all(self.round_times.get(k) for k in self._contenders()):
            self._close_round()
        if self.phase != "estimate":
            self._stop("ended", f"{reason} after {len(self.select_rounds)} selection rounds")
            self._decide()
        self.turns.clear()
        self.round_times = {}
        self.over = True

    def alive(self, keys: Sequence[str] | None = None) -> list[str]:
        """Entrants not out of the race, in ``keys``' order (default: all)."""
        return [k for k in (self.order if keys is None else keys) if self.entrants[k].out is None]

    def _contenders(self) -> list[str]:
        """Entrants alive and not yet beaten with confidence."""
        return [k for k in self.alive() if self.entrants[k].dropped is None]

    def _close_round(self) -> None:
        """File the round: one time per entrant (the median of its steps)."""
        if self.phase == "warmup":
            return
        times = {k: statistics.median(v) for k, v in self.round_times.items() if v and self.entrants[k].out is None}
        self.round_times = {}
        if self.started is not None and self.phase == "select":
            self.elapsed_s = self.clock() - self.started
        if self.agree is not None:
            peaks = {k: e.peak_bytes for k, e in self.entrants.items()}
            agreed = self.agree(RoundReport(times=times, peaks=peaks, elapsed_s=self.elapsed_s))
            self.elapsed_s = agreed.elapsed_s
            for k, peak in agreed.peaks.items():
                if peak is not None:
                    self.entrants[k].peak_bytes = peak
                    self._check_limit(self.entrants[k])
            times = {k: v for k, v in agreed.times.items() if self.entrants[k].out is None}
        (self.select_rounds if self.phase == "select" else self.estimate_rounds).append(times)

    def _next_round(self) -> bool:
        """Queue the next round's turns; ``False`` when the race is over."""
        self._close_round()
        if self.phase == "warmup":
            self.phase = "select"
            self.started = self.clock()
        if self.phase == "select" and self._selection_over():
            self._decide()
            self.estimate_target = self._estimate_target()
        if self.phase == "estimate":
            keys = self._estimate_field()
            if len(keys) < 2 or len(self.estimate_rounds) >= self.estimate_target:
                return False
        else:
            keys = self._contenders()
        shift = len(self.select_rounds if self.phase == "select" else self.estimate_rounds) % len(keys)
        for key in keys[shift:] + keys[:shift]:
            first_visit = key not in self.visited
            self.visited.add(key)
            self.turns.append(Turn(key, False, first_visit or self.meter_every_step, self.phase))
            self.turns.extend(Turn(key, True, self.meter_every_step, self.phase) for _ in range(self.plan.steps))
        return True

    def _stop(self, why: Stop, reason: str) -> bool:
        self.stopped, self.stop_reason = why, reason
        return True

    def _selection_over(self) -> bool:
        alive, rounds, plan = self._contenders(), len(self.select_rounds), self.plan
        if len(alive) < 2:
            return self._stop("one_left", "one entrant left") if alive else self._stop("none_left", "no entrant left")
        if rounds >= plan.max_rounds:
            return self._stop("most_rounds", f"{rounds} rounds (the most allowed)")
        if rounds >= 2 and self.elapsed_s >= plan.time_s:
            return self._stop("time", f"time budget of {plan.time_s:g} s spent after {rounds} rounds")
        total = plan.total_s
        # Never below min_rounds: with fewer no interval reaches the confidence (a tight budget is overspent).
        if rounds >= max(2, plan.min_rounds) and total is not None:
            # A round starts only when it fits, at the pace so far, with the estimation after it.
            estimate_s = self._estimate_target() * self._estimate_round_s()
            if self.elapsed_s + self.elapsed_s / rounds + estimate_s > total:
                if self.elapsed_s + estimate_s <= total:
                    why = f"reached after {rounds} rounds, the estimation's rounds left in it"
                elif rounds <= plan.min_rounds:
                    why = f"overspent to run the race's fewest rounds, {rounds}"
                else:  # the last round was slower than the pace expected
                    why = f"overspent by the last of {rounds} rounds, slower than the ones before"
                return self._stop("budget", f"race budget of {total:.0f} s {why}")
        if rounds >= plan.min_rounds:
            early = stand(self.select_rounds, alive, confidence=plan.stop_confidence)
            level = f"{plan.stop_confidence:.0%}"
            if len(early.beaten()) == len(alive) - 1:
                why = f"leader separated from every other entrant at {level} after {rounds} rounds"
                return self._stop("separated", why)
            # F-Race: an entrant beaten with confidence stops costing rounds.
            for key in early.beaten():
                leader = self.entrants[early.leader].short
                self.entrants[key].dropped = f"beaten by {leader} at {level} after {rounds} rounds"
        return False

    def _estimate_round_s(self) -> float:
        """What one estimation round will take, at the last selection round's median step."""
        last = self.select_rounds[-1] if self.select_rounds else {}
        entrants = 1 + max(1, len(self.references))
        return entrants * (self.plan.steps + 1) * statistics.median(last.values()) if last else 0.0

    def _estimate_target(self) -> int:
        """The plan's estimation rounds, or under a race budget those that fit in `ESTIMATE_SHARE` of it,
        never fewer than `MIN_ESTIMATE_ROUNDS`."""
        total, per_round = self.plan.total_s, self._estimate_round_s()
        if total is None or per_round <= 0:
            return self.plan.estimate_rounds
        return min(self.plan.estimate_rounds, max(MIN_ESTIMATE_ROUNDS, int(ESTIMATE_SHARE * total / per_round)))

    def _decide(self) -> None:
        alive = self.alive()
        self.standing, self.tied, self.winner = verdict(
            self.select_rounds,
            alive,
            {k: self.entrants[k].peak_bytes for k in alive},
            {k: self.entrants[k].short for k in alive},
            confidence=self.plan.confidence,
            tie_margin=self.plan.tie_margin,
        )
        self.phase = "estimate"

    def _estimate_field(self) -> list[str]:
        if self.winner is None or self.entrants[self.winner].out is not None:
            return []
        others = [k for k in self.alive(self.references) if k != self.winner]
        return [self.winner, *others] if others else []

    def result(self, labels: Mapping[str, Sequence[str]] | None = None) -> RaceResult:
        """The race as a `RaceResult` (``ok``), each entrant with its ``labels`` and its policy."""
        standing, win = self.standing, self.winner
        vs: dict[str, Interval] = {}
        for ref in self.alive(self.references) if win is not None else ():
            pairs = [(r[win], r[ref]) for r in self.estimate_rounds if win in r and ref in r]
            if ref != win and len(pairs) >= 2:
                vs[ref] = paired_ratio(*zip(*pairs, strict=True), confidence=self.plan.confidence)
        entrants = {
            k: RaceEntrant(
                **{**vars(e), "policy": e.policy.to_dict()},
                labels=tuple((labels or {}).get(k, ())),
                select_s=tuple(r.get(k) for r in self.select_rounds),
                estimate_s=tuple(r.get(k) for r in self.estimate_rounds),
            )
            for k, e in self.entrants.items()
        }
        return RaceResult(
            outcome="ok",
            entrants=entrants,
            winner=win,
            leader=win if standing is None else standing.leader,
            tied=tuple(self.tied),
            unresolved=() if standing is None else tuple(standing.unresolved()),
            behind={} if standing is None else dict(standing.behind),
            vs=vs,
            stop=self.stop_reason,
            confidence=self.plan.confidence,
            stopped=self.stopped,
            select_rounds=len(self.select_rounds),
            estimate_rounds=len(self.estimate_rounds),
            tokens_per_step=self.tokens,
            samples_per_step=self.samples,
            wall_s=time.perf_counter() - self.began,
            machine_before=self.machine_before,
            machine_after=machine_state(self.device),
        )


class RaceCallback(RecomputeCallback):
    """A `RecomputeCallback` that runs `schedule`'s turns, one optimizer step each, then calls `_over` (by
    default: training stops)."""

    schedule: RaceSchedule | None = None
    turn: Turn | None = None
    tuning_steps = 0
    """Optimizer steps filed with the schedule."""
    _turn_step = -1
    _retried = False
    """The step ran again under another entrant (`AutoRecompute`'s out-of-memory retry): its time is no one's."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.schedule is not None:
            self._advance(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        turn, schedule = self.turn, self.schedule
        if schedule is None or turn is None:
            return
        if not self._retried:
            last, expected = self.records[-1], schedule.entrants[turn.key].policy.fingerprint()
            if last.policy != expected:
                raise RuntimeError(f"race: step {last.step} ran policy {last.policy}, but the turn was {expected}")
            if trainer.global_step == self._turn_step:
                return  # gradient accumulation: the optimizer step is not over; switch only between steps
            # One optimizer step: its micro-batches' times added, the largest peak kept.
            step = list(itertools.takewhile(lambda r: r.step == self._turn_step, reversed(self.records)))[::-1]
            peaks = [r.peak_bytes for r in step if r.peak_bytes is not None]
            tokens = [r.tokens for r in step if r.tokens is not None]
            self.tuning_steps += 1
            schedule.record(
                turn,
                sum(r.seconds for r in step),
                max(peaks) if peaks else None,
                tokens=sum(tokens) if tokens else None,
                samples=sum(r.samples for r in step) or None,
            )
        self._retried = False
        self._advance(trainer, pl_module)

    def _advance(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Put the next turn's policy on (metering the step when the turn says so), or `_over` at the race's end."""
        assert self.schedule is not None
        self.turn = self.schedule.next_turn()
        self._turn_step = trainer.global_step
        if self.turn is None:
            self._over(trainer, pl_module)
            return
        policy = self.schedule.entrants[self.turn.key].policy
        if policy.fingerprint() != self.policy.fingerprint():
            self.switch_policy(pl_module, policy)
        self.memory_steps = frozenset({trainer.global_step}) if self.turn.metered else frozenset()

    def _over(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.should_stop = True


def race(
    model: L.LightningModule,
    datamodule: L.LightningDataModule,
    entrants: Sequence[tuple[str, RecomputePolicy, str]],
    *,
    references: Sequence[str] = (),
    plan: RacePlan | None = None,
    budget_bytes: int | None = None,
    layers: Any = "auto",
    trainer_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The `RaceResult` (as a dict) of ``entrants`` raced as `RaceSchedule` takes them on ``model``, trained in place
    on ``datamodule`` (cycled); ``trainer_kwargs`` are more ``Trainer`` arguments (accelerator, precision)."""
    plan = plan or RacePlan()
    kwargs = dict(trainer_kwargs or {})
    accelerator = str(kwargs.pop("accelerator", "cpu"))
    on_cuda = accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available())
    schedule = RaceSchedule(entrants, references, plan, budget_bytes, meter_every_step=on_cuda, device=accelerator)
    callback = RaceCallback(entrants[0][1], layers=layers, memory_steps=frozenset())
    callback.schedule = schedule
    per_round = len(entrants) * (plan.steps + 1)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=plan.warmup_steps + per_round * (plan.max_rounds + plan.estimate_rounds) + 1,
        max_epochs=-1,  # a short data module cycles
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[callback],
        **QUIET_TRAINER,
        **kwargs,
    )
    trainer.fit(model, datamodule=datamodule)
    return schedule.result().to_dict()


def machine_state(device: str = "cpu") -> dict[str, Any]:
    """``cpu_count`` and, each only where readable, ``load_1m``, ``load_5m``, ``cpu_mhz`` (the mean current
    clock) and on ``cuda`` ``gpu_sm_mhz``, ``gpu_utilization``, ``gpu_processes`` (the others on the device)."""
    state: dict[str, Any] = {"cpu_count": os.cpu_count()}
    with contextlib.suppress(OSError, AttributeError):
        state["load_1m"], state["load_5m"] = (round(x, 2) for x in os.getloadavg()[:2])
    mhz = []
    for path in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_cur_freq"):
        with contextlib.suppress(OSError, ValueError):
            mhz.append(int(path.read_text().strip()) / 1000.0)
    if mhz:
        state["cpu_mhz"] = round(sum(mhz) / len(mhz), 1)
    if device.startswith("cuda") and torch.cuda.is_available():
        # torch.cuda.clock_rate / utilization / list_gpu_processes need pynvml; without it they raise.
        with contextlib.suppress(Exception):
            state["gpu_sm_mhz"] = int(torch.cuda.clock_rate())
        with contextlib.suppress(Exception):
            state["gpu_utilization"] = int(torch.cuda.utilization())
        with contextlib.suppress(Exception):
            mine = f"process {os.getpid():>10}"
            listing = torch.cuda.list_gpu_processes().splitlines()[1:]
            state["gpu_processes"] = [line.strip() for line in listing if line.strip() and mine not in line]
    return state
