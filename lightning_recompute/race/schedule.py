"""The race's schedule: which entrant runs the next step, and what the rounds have decided.

Pure bookkeeping over the step times and peaks it is given, shared by the trial worker's race (`race.engine`)
and `lightning_recompute.auto`. A round runs each entrant once (a settling step, then ``steps`` timed steps)
in an order rotated by one place per round; selection races every entrant until the leader is separated,
then estimation races the winner against the references for the "vs" figures (see docs/TUNER.md, 'The race').
"""

from __future__ import annotations

import enum
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_recompute import RecomputePolicy
from lightning_recompute.race.plan import RacePlan
from lightning_recompute.race.rule import Standing, stand, verdict

__all__ = ["ESTIMATE_SHARE", "MIN_ESTIMATE_ROUNDS", "Agree", "RaceSchedule", "RoundReport", "Stop", "Turn"]

ESTIMATE_SHARE = 0.4
"""Under a race budget (`RacePlan.total_s`), the share of it the estimation's rounds may take."""
MIN_ESTIMATE_ROUNDS = 8
"""Estimation rounds a race budget never cuts below: the fewest whose median's interval reaches 98%."""


class Stop(str, enum.Enum):
    """Why the selection stopped (`RaceSchedule.stopped`; the words with the figures: `stop_reason`)."""

    SEPARATED = "separated"
    ONE_LEFT = "one_left"
    NONE_LEFT = "none_left"
    MOST_ROUNDS = "most_rounds"
    TIME = "time"
    BUDGET = "budget"
    ENDED = "ended"


@dataclass(frozen=True)
class Turn:
    """One training step of the race: whose, and whether it is timed and metered."""

    key: str
    timed: bool
    """Its time counts in the round (the settling step after a switch does not)."""
    metered: bool
    """Its peak memory is measured (every step on CUDA; on CPU the first visit)."""
    phase: str
    """``warmup``, ``select`` or ``estimate``."""


@dataclass(frozen=True)
class RoundReport:
    """What one process measured in a round, as `RaceSchedule.agree` sees it."""

    times: dict[str, float]
    """Entrant key -> its time in the round (the median of its timed steps)."""
    peaks: dict[str, int | None]
    """Entrant key -> its largest metered peak so far (``None``: never metered)."""
    elapsed_s: float
    """Seconds of selection so far, by this process's clock."""


Agree = Callable[[RoundReport], RoundReport]
"""What several processes racing together take from each one's `RoundReport` (rank 0's times, the largest peak)."""


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


class RaceSchedule:
    """The turns of a race and its decision, fed one measured step at a time.

    Use: ``turn = next_turn()``; run a step under ``turn.key``'s policy; ``record(turn, seconds, peak)``;
    repeat until `next_turn` returns ``None``; then `winner` and `result`.

    Args:
        entrants: ``(key, policy, short)`` per candidate, at least one; the first runs the warm-up.
        references: keys of the entrants the winner's "vs" figures are about.
        plan: how long and how sure (`RacePlan`).
        budget_bytes: an entrant whose metered peak exceeds it is out.
        meter_every_step: meter every step (CUDA, where it is free), not only first visits.
        clock: seconds, for the selection's time budget.
        agree: what several processes racing together take from each one's round (``None``: one process);
            with it an entrant over the limit is out at the round's end, so no rank skips a turn.
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
        agree: Agree | None = None,
    ) -> None:
        if not entrants:
            raise ValueError("a race needs at least one entrant")
        keys = [k for k, _, _ in entrants]
        if len(set(keys)) != len(keys):
            raise ValueError(f"entrant keys must be unique: {keys}")
        self.plan = plan or RacePlan()
        self.entrants = {k: _Entrant(k, p, s) for k, p, s in entrants}
        self.order = keys
        self.references = [k for k in references if k in self.entrants]
        self.budget = budget_bytes
        self.meter_every_step = meter_every_step
        self.clock = clock
        self.agree = agree
        self.phase = "warmup"
        self.turns: deque[Turn] = deque(Turn(keys[0], False, False, "warmup") for _ in range(self.plan.warmup_steps))
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
        entrant = self.entrants[key]
        if entrant.out is None:
            entrant.out = reason
        self.turns = deque(t for t in self.turns if t.key != key)
        self.round_times.pop(key, None)

    def _check_limit(self, entrant: _Entrant) -> None:
        peak = entrant.peak_bytes
        if self.budget is not None and peak is not None and peak > self.budget and entrant.out is None:
            self.knock_out(entrant.key, f"peaked at {peak} bytes in the race, over the limit {self.budget}")

    def finish(self, reason: str) -> None:
        """End the race now (the job ran out of steps) and decide on the rounds there are.

        The round in progress counts when every contender ran in it. The stop reason is
        ``"<reason> after <n> selection rounds"``.
        """
        if self.over:
            return
        if self.phase == "select" and all(self.round_times.get(k) for k in self._contenders()):
            self._close_round()  # the round in progress counts when every contender ran in it
        if self.phase != "estimate":
            self.stop_reason = f"{reason} after {len(self.select_rounds)} selection rounds"
            self.stopped = Stop.ENDED
            self._decide()
            self.phase = "estimate"
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
            times = {k: v for k, v in agreed.times.items() if k in self.entrants}
            self.elapsed_s = agreed.elapsed_s
            for k, peak in agreed.peaks.items():
                if k in self.entrants and peak is not None:
                    self.entrants[k].peak_bytes = peak
                    self._check_limit(self.entrants[k])
            times = {k: v for k, v in times.items() if self.entrants[k].out is None}
        rounds = self.select_rounds if self.phase == "select" else self.estimate_rounds
        rounds.append(times)
        for k, e in self.entrants.items():
            (e.select if self.phase == "select" else e.estimate).append(times.get(k))

    def _next_round(self) -> bool:
        """Queue the next round's turns; ``False`` when the race is over."""
        self._close_round()
        if self.phase == "warmup":
            self.phase = "select"
            self.started = self.clock()
        if self.phase == "select" and self._selection_over():
            self._decide()
            self.phase = "estimate"
            self.estimate_target = self._estimate_target()
        if self.phase == "estimate":
            field_ = self._estimate_field()
            if len(field_) < 2 or len(self.estimate_rounds) >= self.estimate_target:
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
            self.turns.append(Turn(key, False, first_visit or self.meter_every_step, phase))
            self.turns.extend(Turn(key, True, self.meter_every_step, phase) for _ in range(self.plan.steps))

    def _selection_over(self) -> bool:
        alive = self._contenders()
        rounds = len(self.select_rounds)
        if len(alive) < 2:
            self.stop_reason = "one entrant left" if alive else "no entrant left"
            self.stopped = Stop.ONE_LEFT if alive else Stop.NONE_LEFT
            return True
        if rounds >= self.plan.max_rounds:
            self.stop_reason = f"{rounds} rounds (the most allowed)"
            self.stopped = Stop.MOST_ROUNDS
            return True
        if rounds >= 2 and self.elapsed_s >= self.plan.time_s:
            self.stop_reason = f"time budget of {self.plan.time_s:g} s spent after {rounds} rounds"
            self.stopped = Stop.TIME
            return True
        total = self.plan.total_s
        # Never below min_rounds: with fewer no interval reaches the confidence (a tight budget is overspent).
        if rounds >= max(2, self.plan.min_rounds) and total is not None:
            # A round starts only when it fits, at the pace so far, with the estimation after it.
            pace = self.elapsed_s / rounds
            estimate_s = self._estimate_target() * self._estimate_round_s()
            if self.elapsed_s + pace + estimate_s > total:
                if self.elapsed_s + estimate_s <= total:
                    why = f"reached after {rounds} rounds, the estimation's rounds left in it"
                elif rounds <= self.plan.min_rounds:
                    why = f"overspent to run the race's fewest rounds, {rounds}"
                else:  # the last round was slower than the pace expected
                    why = f"overspent by the last of {rounds} rounds, slower than the ones before"
                self.stop_reason = f"race budget of {total:.0f} s {why}"
                self.stopped = Stop.BUDGET
                return True
        if rounds >= self.plan.min_rounds:
            early = stand(self.select_rounds, alive, confidence=self.plan.stop_confidence)
            level = f"{self.plan.stop_confidence:.0%}"
            if len(early.beaten()) == len(alive) - 1:
                self.stop_reason = f"leader separated from every other entrant at {level} after {rounds} rounds"
                self.stopped = Stop.SEPARATED
                return True
            # F-Race: an entrant beaten with confidence stops costing rounds.
            for key in early.beaten():
                leader = self.entrants[early.leader].short
                self.entrants[key].dropped = f"beaten by {leader} at {level} after {rounds} rounds"
        return False

    def _estimate_round_s(self) -> float:
        """What one estimation round will take, at the last selection round's median step."""
        last = self.select_rounds[-1] if self.select_rounds else {}
        if not last:
            return 0.0
        entrants = 1 + max(1, len(self.references))
        return entrants * (self.plan.steps + 1) * statistics.median(last.values())

    def _estimate_target(self) -> int:
        """The estimation's rounds: the plan's, or under a race budget those that fit in `ESTIMATE_SHARE`
        of it, never fewer than `MIN_ESTIMATE_ROUNDS`.
        """
        total, per_round = self.plan.total_s, self._estimate_round_s()
        if total is None or per_round <= 0:
            return self.plan.estimate_rounds
        fit = int(ESTIMATE_SHARE * total / per_round)
        return min(self.plan.estimate_rounds, max(MIN_ESTIMATE_ROUNDS, fit))

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

    def _estimate_field(self) -> list[str]:
        if self.winner is None or self.entrants[self.winner].out is not None:
            return []
        others = [k for k in self.alive(self.references) if k != self.winner]
        return [self.winner, *others] if others else []

    def vs(self) -> dict[str, dict[str, Any]]:
        """The winner's estimation-round intervals against each reference (reference time over winner's)."""
        from lightning_recompute.race.stats import paired_ratio

        out: dict[str, dict[str, Any]] = {}
        if self.winner is None:
            return out
        for ref in self.alive(self.references):
            if ref == self.winner:
                continue
            pairs = [(r[self.winner], r[ref]) for r in self.estimate_rounds if self.winner in r and ref in r]
            if len(pairs) >= 2:
                iv = paired_ratio([p[0] for p in pairs], [p[1] for p in pairs], confidence=self.plan.confidence)
                out[ref] = iv.to_dict()
        return out

    def result(self) -> dict[str, Any]:
        """The JSON-ready race record (`RaceResult.from_worker` reads it)."""
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
                "stopped": None if self.stopped is None else self.stopped.value,
                "leader": None if standing is None else standing.leader,
                "behind": {} if standing is None else {k: iv.to_dict() for k, iv in standing.behind.items()},
                "tied": list(self.tied),
                "unresolved": [] if standing is None else standing.unresolved(),
                "winner": self.winner,
            },
            "estimate": {"rounds": len(self.estimate_rounds), "vs": self.vs()},
            "tokens_per_step": self.tokens,
            "samples_per_step": self.samples,
            "select_wall_s": None if self.started is None else self.elapsed_s,
        }
