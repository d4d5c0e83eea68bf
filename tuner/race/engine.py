"""The race itself: candidate policies measured in turn on one model in one Lightning fit.

Runs inside a trial worker (`tuner.trials.worker`, spec kind ``race``). One model, one optimizer,
one data stream: between steps `RecomputeCallback.switch_policy` puts the next candidate's policy
on, so every candidate sees the same allocator, caches and moments of the machine. Recomputation
never changes what a step computes, so every step of the race is an ordinary training step.

A round runs each entrant once, in an order rotated by one place per round (an order that
alternates runs the end entrants twice in a row, and that biased identical models by up to 5% on
this project's 2-core machine; rotation spread them least). An entrant's turn is one settling step
after the switch (not timed: the first step under a new policy pays for the allocator's
reshuffle; on CPU it is the step the memory ledger meters, whose cost would distort the time)
and then ``steps`` timed steps; its time in the round is their median.

Two phases, because the fastest of several noisy medians is biased low: **selection** races every
entrant until the leader is separated from the rest with confidence (`tuner.race.rule`), or the
rounds or the time run out; the entrants left within noise of the leader are tied, and the tie is
broken by headroom, then by less recomputation. **Estimation** then races the winner against the
references (the baselines a "vs" figure is about) for fresh rounds, and only those rounds give the
figures shown to a user.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch

from lightning_recompute import QUIET_TRAINER, RecomputeCallback, RecomputePolicy
from tuner.race.machine import machine_state
from tuner.race.plan import RacePlan
from tuner.race.rule import Standing, stand, verdict

__all__ = ["race"]


@dataclass
class _Entrant:
    key: str
    policy: RecomputePolicy
    short: str
    peak_bytes: int | None = None
    out: str | None = None
    dropped: str | None = None
    select: list[float | None] = field(default_factory=list)
    estimate: list[float | None] = field(default_factory=list)


@dataclass(frozen=True)
class _Turn:
    key: str
    timed: bool
    metered: bool
    phase: str


class _Race(L.Callback):
    """Decides, after each training batch, which entrant runs the next one (placed after `RecomputeCallback`)."""

    def __init__(
        self,
        recompute: RecomputeCallback,
        entrants: list[_Entrant],
        references: Sequence[str],
        plan: RacePlan,
        budget_bytes: int | None,
        meter_every_step: bool,
    ) -> None:
        self.recompute = recompute
        self.entrants = {e.key: e for e in entrants}
        self.order = [e.key for e in entrants]
        self.references = [k for k in references if k in self.entrants]
        self.plan = plan
        self.budget = budget_bytes
        self.meter_every_step = meter_every_step
        self.phase = "warmup"
        self.turns: deque[_Turn] = deque(_Turn(self.order[0], False, False, "warmup") for _ in range(plan.warmup_steps))
        self.current: _Turn | None = None
        self.round_times: dict[str, list[float]] = {}
        self.select_rounds: list[dict[str, float]] = []
        self.estimate_rounds: list[dict[str, float]] = []
        self.visited: set[str] = set()
        self.started: float | None = None
        self.stop_reason = ""
        self.standing: Standing | None = None
        self.winner: str | None = None
        self.tied: list[str] = []
        self.tokens: int | None = None
        self.samples: int | None = None
        self.active = self.order[0]

    # -------------------------------------------------------------- hooks

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._advance(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        record = self.recompute.records[-1]
        turn = self.current
        if turn is not None and turn.phase != "warmup":
            entrant = self.entrants[turn.key]
            if record.policy != entrant.policy.fingerprint():
                # A step measured under another policy than the turn's would be filed under the wrong name.
                expected = entrant.policy.fingerprint()
                raise RuntimeError(f"race: step {record.step} ran policy {record.policy}, but the turn was {expected}")
            if record.peak_bytes is not None:
                entrant.peak_bytes = max(entrant.peak_bytes or 0, record.peak_bytes)
                if self.budget is not None and record.peak_bytes > self.budget and entrant.out is None:
                    entrant.out = f"peaked at {record.peak_bytes} bytes in the race, over the limit {self.budget}"
                    self.turns = deque(t for t in self.turns if t.key != turn.key)
            if turn.timed and entrant.out is None:
                self.round_times.setdefault(turn.key, []).append(record.seconds)
                self.tokens, self.samples = record.tokens, record.samples
        self._advance(trainer, pl_module)

    # -------------------------------------------------------------- schedule

    def _advance(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        while not self.turns:
            if not self._next_round():
                self.current = None
                trainer.should_stop = True
                return
        turn = self.turns.popleft()
        if turn.key != self.active:
            self.recompute.switch_policy(pl_module, self.entrants[turn.key].policy)
            self.active = turn.key
        self.recompute.memory_steps = frozenset({trainer.global_step}) if turn.metered else frozenset()
        self.current = turn

    def _alive(self, keys: Sequence[str]) -> list[str]:
        """Entrants not out of the race (over the limit)."""
        return [k for k in keys if self.entrants[k].out is None]

    def _contenders(self) -> list[str]:
        """Entrants the selection still races: alive and not yet beaten with confidence."""
        return [k for k in self._alive(self.order) if self.entrants[k].dropped is None]

    def _close_round(self) -> None:
        """Turn the round's step times into one time per entrant (its median) and file the round."""
        if self.phase == "warmup":
            return
        times = {k: statistics.median(v) for k, v in self.round_times.items() if v and self.entrants[k].out is None}
        self.round_times = {}
        rounds = self.select_rounds if self.phase == "select" else self.estimate_rounds
        rounds.append(times)
        for k, e in self.entrants.items():
            (e.select if self.phase == "select" else e.estimate).append(times.get(k))

    def _next_round(self) -> bool:
        """Queue the next round's turns; ``False`` when the race is over."""
        self._close_round()
        if self.phase == "warmup":
            self.phase = "select"
            self.started = time.perf_counter()
        if self.phase == "select" and self._selection_over():
            self._decide()
            self.phase = "estimate"
        if self.phase == "estimate":
            field_ = self._estimate_field()
            if len(field_) < 2 or len(self.estimate_rounds) >= self.plan.estimate_rounds:
                return False
            self._queue(field_, len(self.estimate_rounds), "estimate")
            return True
        self._queue(self._contenders(), len(self.select_rounds), "select")
        return True

    def _queue(self, keys: list[str], index: int, phase: str) -> None:
        shift = index % len(keys)
        for key in keys[shift:] + keys[:shift]:
            first_visit = key not in self.visited
            self.visited.add(key)
            self.turns.append(_Turn(key, False, first_visit or self.meter_every_step, phase))
            self.turns.extend(_Turn(key, True, self.meter_every_step, phase) for _ in range(self.plan.steps))

    def _selection_over(self) -> bool:
        alive = self._contenders()
        rounds = len(self.select_rounds)
        if len(alive) < 2:
            self.stop_reason = "one entrant left" if alive else "no entrant left"
            return True
        if rounds >= self.plan.max_rounds:
            self.stop_reason = f"{rounds} rounds (the most allowed)"
            return True
        elapsed = time.perf_counter() - (self.started or time.perf_counter())
        if rounds >= 2 and elapsed >= self.plan.time_s:
            self.stop_reason = f"time budget of {self.plan.time_s:g} s spent after {rounds} rounds"
            return True
        if rounds >= self.plan.min_rounds:
            early = stand(self.select_rounds, alive, confidence=self.plan.stop_confidence)
            level = f"{self.plan.stop_confidence:.0%}"
            if len(early.beaten()) == len(alive) - 1:
                self.stop_reason = f"leader separated from every other entrant at {level} after {rounds} rounds"
                return True
            # Racing (F-Race): an entrant beaten with confidence stops costing rounds; the rounds
            # left go to the ones the race cannot tell apart yet.
            for key in early.beaten():
                leader = self.entrants[early.leader].short
                self.entrants[key].dropped = f"beaten by {leader} at {level} after {rounds} rounds"
        return False

    def _decide(self) -> None:
        alive = self._alive(self.order)
        self.standing, self.tied, self.winner = verdict(
            self.select_rounds,
            alive,
            {k: self.entrants[k].peak_bytes for k in alive},
            {k: self.entrants[k].short for k in alive},
            confidence=self.plan.confidence,
            tie_margin=self.plan.tie_margin,
        )

    def _estimate_field(self) -> list[str]:
        if self.winner is None:
            return []
        refs = [k for k in self._alive(self.references) if k != self.winner]
        return [self.winner, *refs] if refs else []

    # -------------------------------------------------------------- result

    def result(self) -> dict[str, Any]:
        from tuner.race.stats import paired_ratio

        vs: dict[str, dict[str, Any]] = {}
        if self.winner is not None:
            for ref in self._alive(self.references):
                if ref == self.winner:
                    continue
                pairs = [(r[self.winner], r[ref]) for r in self.estimate_rounds if self.winner in r and ref in r]
                if len(pairs) >= 2:
                    iv = paired_ratio([p[0] for p in pairs], [p[1] for p in pairs], confidence=self.plan.confidence)
                    vs[ref] = iv.to_dict()
        standing = self.standing
        return {
            "entrants": {
                k: {
                    "short": e.short,
                    "fingerprint": e.policy.fingerprint(),
                    "peak_bytes": e.peak_bytes,
                    "out": e.out,
                    "dropped": e.dropped,
                    "select_s": e.select,
                    "estimate_s": e.estimate,
                }
                for k, e in self.entrants.items()
            },
            "selection": {
                "rounds": len(self.select_rounds),
                "stop": self.stop_reason,
                "leader": None if standing is None else standing.leader,
                "behind": {} if standing is None else {k: iv.to_dict() for k, iv in standing.behind.items()},
                "tied": list(self.tied),
                "unresolved": [] if standing is None else standing.unresolved(),
                "winner": self.winner,
            },
            "estimate": {"rounds": len(self.estimate_rounds), "vs": vs},
            "tokens_per_step": self.tokens,
            "samples_per_step": self.samples,
            "select_wall_s": None if self.started is None else time.perf_counter() - self.started,
        }


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
    """Race ``entrants`` (``(key, policy, short)``, at least one) on ``model`` and return what happened.

    Args:
        model: the LightningModule, freshly built; it is trained in place.
        datamodule: its data (a finite one is cycled).
        entrants: the candidates, each with a unique key and its glyphs (for the tie-break).
        references: keys of the entrants the winner's "vs" figures are about (estimation phase).
        plan: how long and how sure (`RacePlan`).
        budget_bytes: an entrant whose metered peak exceeds it is out at once.
        layers: which modules are layers, as for `RecomputeCallback`.
        trainer_kwargs: more ``Trainer`` arguments (accelerator, precision, strategy).

    Returns:
        The JSON-ready race record: per entrant its per-round times (``select_s``, ``estimate_s``,
        ``None`` for a round it did not run), peak and whether it is out; the selection's standing,
        stop reason, tie and winner; the estimation's intervals (``vs``: the reference's time over the
        winner's); the machine's state before and after.
    """
    if not entrants:
        raise ValueError("a race needs at least one entrant")
    keys = [k for k, _, _ in entrants]
    if len(set(keys)) != len(keys):
        raise ValueError(f"entrant keys must be unique: {keys}")
    plan = plan or RacePlan()
    kwargs = dict(trainer_kwargs or {})
    accelerator = str(kwargs.pop("accelerator", "cpu"))
    recompute = RecomputeCallback(entrants[0][1], layers=layers, memory_steps=frozenset())
    racer = _Race(
        recompute,
        [_Entrant(k, p, s) for k, p, s in entrants],
        references,
        plan,
        budget_bytes,
        meter_every_step=accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available()),
    )
    per_round = len(entrants) * (plan.steps + 1)
    bound = plan.warmup_steps + per_round * (plan.max_rounds + plan.estimate_rounds) + 1
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=bound,
        max_epochs=-1,  # a short data module cycles
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[recompute, racer],
        **QUIET_TRAINER,
        **kwargs,
    )
    before = machine_state(accelerator)
    began = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    out = racer.result()
    out.update(
        outcome="ok",
        wall_s=time.perf_counter() - began,
        machine_before=before,
        machine_after=machine_state(accelerator),
        plan=plan.to_dict(),
    )
    return out
