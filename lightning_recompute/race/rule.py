"""Who leads a race, who is beaten, and who is tied: the decision over per-round step times.

Pure functions of the measurements (no model, no clock), so the decision can be tested exactly.
The statistics and why they were chosen are in `lightning_recompute.race.stats`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_recompute.modes import MODES, Mode
from lightning_recompute.race.stats import Interval, paired_ratio

__all__ = ["TIE_MARGIN", "Standing", "recompute_strength", "stand", "tie_break", "verdict"]

TIE_MARGIN = 0.03
"""The default `Standing.tie_margin` (`RacePlan.tie_margin`)."""


@dataclass(frozen=True)
class Standing:
    """The state of a race after some rounds."""

    leader: str
    """The entrant fastest relative to the others, round by round."""
    behind: dict[str, Interval]
    """Every other entrant's time over the leader's (above 1: slower), with its interval."""
    confidence: float = 0.95
    """The confidence asked for: an interval whose coverage is below it (too few rounds) beats nobody."""
    tie_margin: float = TIE_MARGIN
    """How far behind the leader an entrant the race could not separate may be and still be tied with it:
    the upper end of its interval (not only its median) must be within it."""

    def beaten(self) -> list[str]:
        """Entrants slower than the leader with at least the confidence asked for."""
        return [k for k, iv in self.behind.items() if iv.low > 1.0 and iv.confidence >= self.confidence]

    def tied(self) -> list[str]:
        """Entrants the race cannot tell from the leader and has seen close to it: the upper end of their
        interval, at the confidence asked for, is within `tie_margin` of the leader (tie within noise).

        The interval, not the median: a race cut short on a loaded machine has wide intervals, and a
        median within the margin then says little (one such race tied a policy 9% behind the leader,
        and the tie-break, which favours headroom, promoted it). A tie is a claim that the two train
        equally fast; it needs the race to have measured that, not only to have failed to separate them,
        and with the same confidence as a separation (two rounds within 3% of each other are no such
        measurement).
        """
        beaten = set(self.beaten())
        return [
            k
            for k, iv in self.behind.items()
            if k not in beaten and iv.high <= 1.0 + self.tie_margin and iv.confidence >= self.confidence
        ]

    def unresolved(self) -> list[str]:
        """Entrants the race could neither separate from the leader nor see within `tie_margin` of it.

        Not a tie: a race that runs out of rounds on a noisy machine leaves wide intervals, and a tie
        would hand the choice to the tie-break (most headroom), which favours the slowest policy. The
        leader is the best estimate the race has, so it wins over these.
        """
        settled = {*self.beaten(), *self.tied()}
        return [k for k in self.behind if k not in settled]


def stand(
    rounds: Sequence[Mapping[str, float]], entrants: Sequence[str], *, confidence: float, tie_margin: float = TIE_MARGIN
) -> Standing:
    """The standing of ``entrants`` over ``rounds`` (each: entrant -> its time in that round).

    The leader has the lowest median, over rounds, of its log time less the round's mean log time
    of the entrants present (so a slow round weighs on nobody). Each other entrant is compared with
    the leader on the rounds both ran (`paired_ratio`).

    Raises:
        ValueError: no entrant, or an entrant with fewer than 2 rounds beside the leader.
    """
    if not entrants:
        raise ValueError("a race needs at least one entrant")
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
    behind: dict[str, Interval] = {}
    for k in entrants:
        if k == leader:
            continue
        pairs = [(t[leader], t[k]) for t in rounds if leader in t and k in t]
        a, b = [p[0] for p in pairs], [p[1] for p in pairs]
        behind[k] = paired_ratio(a, b, confidence=confidence)
    return Standing(leader=leader, behind=behind, confidence=confidence, tie_margin=tie_margin)


_STRENGTH = {s.glyph: s.recompute for s in MODES}
"""How much a layer's mode recomputes, by its glyph (`RecomputePolicy.short`), from
`lightning_recompute.modes.ModeSpec.recompute`: none keeps everything, offload recomputes nothing but
moves activations, the selective families recompute the cheap ops, full recomputes the layer."""
_UNKNOWN_STRENGTH = max(_STRENGTH.values())
"""A glyph of no mode counts as the most recomputation."""
_FULL = next(s.glyph for s in MODES if s.name == Mode.FULL.value)


def recompute_strength(short: str) -> tuple[int, int]:
    """How much a policy recomputes, from its glyphs: (layers recomputed in full, total strength)."""
    return short.count(_FULL), sum(_STRENGTH.get(g, _UNKNOWN_STRENGTH) for g in short)


def tie_break(tied: Sequence[str], peaks: Mapping[str, int | None], shorts: Mapping[str, str]) -> str:
    """Of entrants tied within noise, the one a user wants: the most memory headroom (lowest peak),
    then the least recomputation, then the first given (the leader)."""

    def key(k: str) -> tuple[float, tuple[int, int], int]:
        peak = peaks.get(k)
        return (math.inf if peak is None else float(peak), recompute_strength(shorts.get(k, "")), tied.index(k))

    return min(tied, key=key)


def verdict(
    rounds: Sequence[Mapping[str, float]],
    entrants: Sequence[str],
    peaks: Mapping[str, int | None],
    shorts: Mapping[str, str],
    *,
    confidence: float,
    tie_margin: float = TIE_MARGIN,
) -> tuple[Standing | None, list[str], str | None]:
    """The selection's outcome: ``(standing, tied, winner)``.

    ``tied`` is the leader and every entrant within noise of it (`Standing.tied`); ``winner`` is
    `tie_break` of them.
    With one entrant (or fewer than 2 rounds) it wins alone and there is no standing; with none,
    nobody wins.
    """
    if not entrants:
        return None, [], None
    if len(entrants) == 1 or len(rounds) < 2:
        return None, [entrants[0]], entrants[0]
    standing = stand(rounds, entrants, confidence=confidence, tie_margin=tie_margin)
    tied = [standing.leader, *standing.tied()]
    return standing, tied, tie_break(tied, peaks, shorts)
