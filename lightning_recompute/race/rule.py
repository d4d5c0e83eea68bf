"""Who leads a race, who is beaten, and who is tied: pure functions over per-round step times (`race.stats`), and
`RacePlan`, how long a race runs and how sure it must be (the recipe's ``race`` section as the race reads it)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from lightning_recompute.modes import MODES, Mode
from lightning_recompute.race.stats import Interval, paired_ratio

__all__ = ["TIE_MARGIN", "RacePlan", "Standing", "recompute_strength", "stand", "tie_break", "verdict"]

TIE_MARGIN = 0.03


@dataclass(frozen=True)
class RacePlan:
    """How long a race runs and how sure it must be (the user's view: `tuner.recipe._schema.RaceSettings`)."""

    steps: int = 2
    """Timed steps per entrant per round (after one settling step)."""
    min_rounds: int = 6
    """Selection rounds before the race may stop early (separated leader, or the budget)."""
    max_rounds: int = 30
    time_s: float = 120.0
    """Seconds of selection rounds at most (the round in progress finishes)."""
    total_s: float | None = None
    """Seconds of rounds at most, both phases (``None``: no cap); the selection still runs `min_rounds`."""
    estimate_rounds: int = 16
    """Rounds of the estimation phase (the winner against the references)."""
    confidence: float = 0.95
    """Confidence of the intervals reported, and of "tied"."""
    tie_margin: float = TIE_MARGIN
    stop_confidence: float = 0.99
    """Confidence to stop before `max_rounds` (stricter: it looks after every round)."""
    warmup_steps: int = 2
    """Steps before the first round, neither timed nor metered."""

    # Who races and for how long, in the tuning service.
    leaders: int = 4
    """The fastest fitting trials that race (besides the planner's pick and the baselines)."""
    predicted: int = 2
    """More fitting trials that race because the planner predicts them fastest (its view shares no trial noise)."""
    share: float | None = 0.25
    """The rounds take at most this share of the search's trial time (``None``: only the round and time limits)."""
    min_s: float = 30.0
    """Seconds of rounds the share never cuts below (a share of seconds gives useless intervals)."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RacePlan:
        """The inverse of `to_dict` (unknown keys, from a newer parent, are ignored)."""
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def within(self, search_s: float | None) -> RacePlan:
        """This plan with its `total_s` for a search of ``search_s`` seconds: ``share`` of it, at least ``min_s``."""
        total = max(self.min_s, self.share * search_s) if search_s and self.share is not None else None
        return replace(self, total_s=total)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Standing:
    """Every other entrant's time over the leader's (above 1: slower); an interval whose coverage is below
    ``confidence`` beats nobody and ties with nobody."""

    leader: str
    behind: dict[str, Interval]
    confidence: float = 0.95
    tie_margin: float = TIE_MARGIN
    """How far behind the leader the upper end of an unseparated entrant's interval may be for a tie."""

    def beaten(self) -> list[str]:
        """Entrants slower than the leader with the confidence asked for."""
        return [k for k, iv in self.behind.items() if iv.confidence >= self.confidence and iv.low > 1.0]

    def tied(self) -> list[str]:
        """Entrants not beaten whose interval (not only the median: a tie claims what the race must have measured)
        ends within `tie_margin`."""
        return [
            k
            for k, iv in self.behind.items()
            if iv.confidence >= self.confidence and iv.low <= 1.0 and iv.high <= 1.0 + self.tie_margin
        ]

    def unresolved(self) -> list[str]:
        """Entrants neither separated from the leader nor within `tie_margin`: the leader wins over them."""
        settled = {*self.beaten(), *self.tied()}
        return [k for k in self.behind if k not in settled]


def stand(
    rounds: Sequence[Mapping[str, float]], entrants: Sequence[str], *, confidence: float, tie_margin: float = TIE_MARGIN
) -> Standing:
    """The standing of ``entrants`` over ``rounds`` (entrant -> time): the leader has the lowest median of its
    log time less the round's mean; each other is paired with it (`ValueError` below 2 rounds beside it)."""
    rel: dict[str, list[float]] = {k: [] for k in entrants}
    for times in rounds:
        present = [k for k in entrants if k in times]
        if len(present) < 2:
            continue
        mean = statistics.fmean(math.log(times[k]) for k in present)
        for k in present:
            rel[k].append(math.log(times[k]) - mean)
    scored = [k for k in entrants if rel[k]]
    leader = min(scored, key=lambda k: (statistics.median(rel[k]), entrants.index(k))) if scored else entrants[0]
    behind = {}
    for k in entrants:
        if k != leader:
            pairs = [(t[leader], t[k]) for t in rounds if leader in t and k in t]
            behind[k] = paired_ratio([a for a, _ in pairs], [b for _, b in pairs], confidence=confidence)
    return Standing(leader=leader, behind=behind, confidence=confidence, tie_margin=tie_margin)


_STRENGTH = {s.glyph: s.recompute for s in MODES}
_FULL = next(s.glyph for s in MODES if s.name == Mode.FULL.value)


def recompute_strength(short: str) -> tuple[int, int]:
    """How much a policy recomputes, from its glyphs: (layers recomputed in full, total strength)."""
    return short.count(_FULL), sum(_STRENGTH.get(g, max(_STRENGTH.values())) for g in short)


def tie_break(tied: Sequence[str], peaks: Mapping[str, int | None], shorts: Mapping[str, str]) -> str:
    """Of tied entrants, the lowest peak, then the least recomputation, then the first given (the leader)."""
    return min(
        tied, key=lambda k: (math.inf if (p := peaks.get(k)) is None else p, recompute_strength(shorts.get(k, "")))
    )


def verdict(
    rounds: Sequence[Mapping[str, float]],
    entrants: Sequence[str],
    peaks: Mapping[str, int | None],
    shorts: Mapping[str, str],
    *,
    confidence: float,
    tie_margin: float = TIE_MARGIN,
) -> tuple[Standing | None, list[str], str | None]:
    """``(standing, tied, winner)``, ``winner`` the `tie_break` of ``tied``; one entrant (or fewer than 2 rounds)
    wins alone, with no standing."""
    if not entrants:
        return None, [], None
    if len(entrants) == 1 or len(rounds) < 2:
        return None, [entrants[0]], entrants[0]
    standing = stand(rounds, entrants, confidence=confidence, tie_margin=tie_margin)
    tied = [standing.leader, *standing.tied()]
    return standing, tied, tie_break(tied, peaks, shorts)
