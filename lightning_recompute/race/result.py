"""What a race found, as the parent reads it: the winner, the tie, and figures with their intervals."""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_recompute.race.rule import recompute_strength
from lightning_recompute.race.stats import Interval

__all__ = ["RaceEntrant", "RaceResult", "Stop", "format_gain"]


Stop = Literal["separated", "one_left", "none_left", "most_rounds", "time", "budget", "ended"]
"""Why the selection stopped (`RaceResult.stopped`; in words with the figures: `RaceResult.stop`)."""


@dataclass(frozen=True)
class RaceEntrant:
    """One policy in a race."""

    key: str
    short: str
    labels: tuple[str, ...]
    """Why it raced: ``trial 12``, ``planner``, ``baseline full``, ``good`` ..."""
    peak_bytes: int | None = None
    out: str | None = None
    """Why it left the race (over the limit, out of memory), or ``None``."""
    dropped: str | None = None
    """Why the selection stopped racing it (beaten with confidence), or ``None``."""
    select_s: tuple[float | None, ...] = ()
    """Its time per selection round (``None``: not run that round)."""
    estimate_s: tuple[float | None, ...] = ()
    policy: dict[str, Any] | None = None
    """Its policy (`RecomputePolicy.to_dict`), so a reader can run it again; ``None`` in older records."""

    @property
    def label(self) -> str:
        return " = ".join(self.labels) if self.labels else self.key


def format_gain(interval: Interval, confidence: float = 0.95) -> str:
    """``+6.1% (95% CI +4.8..+7.3%, interleaved, 14 rounds)`` for a time ratio ``reference / winner``, stated at
    `Interval.stated` ``confidence``."""
    gain, low, high = interval.gain()
    return (
        f"{gain * 100:+.1f}% ({interval.stated(confidence):.0%} CI {low * 100:+.1f}..{high * 100:+.1f}%, "
        f"interleaved, {interval.rounds} rounds)"
    )


@dataclass(frozen=True)
class RaceResult:
    """A race's outcome: ``ok`` with a winner, or why there was none (``failed``, ``skipped``: ``reason``)."""

    outcome: Literal["ok", "failed", "skipped"]
    reason: str | None = None
    entrants: dict[str, RaceEntrant] = field(default_factory=dict)
    winner: str | None = None
    """The leader, or of those tied with it the most headroom, then least recomputation."""
    leader: str | None = None
    """The fastest entrant by the selection rounds."""
    tied: tuple[str, ...] = ()
    """The leader and every entrant within noise of it."""
    unresolved: tuple[str, ...] = ()
    """Entrants neither separated from the leader nor within the tie margin of it."""
    behind: dict[str, Interval] = field(default_factory=dict)
    """Selection: each entrant's time over the leader's."""
    vs: dict[str, Interval] = field(default_factory=dict)
    """Estimation: each reference's time over the winner's (above 1: the winner is faster)."""
    stop: str = ""
    confidence: float = 0.95
    """The confidence the race was asked for; its intervals are stated at it (`format_gain`)."""
    stopped: Stop | None = None
    """Why the selection stopped (``None``: no race ran, or an older record)."""
    select_rounds: int = 0
    estimate_rounds: int = 0
    tokens_per_step: int | None = None
    samples_per_step: int | None = None
    wall_s: float = 0.0
    machine_before: dict[str, Any] = field(default_factory=dict)
    machine_after: dict[str, Any] = field(default_factory=dict)
    trial_scale: float | None = None
    """The lowest ratio of an entrant's trial throughput (own process) to its race throughput (`calibrated`)."""

    @property
    def ok(self) -> bool:
        return self.outcome == "ok" and self.winner is not None

    @property
    def unit(self) -> str:
        return "tokens/s" if self.tokens_per_step else "samples/s"

    def throughput(self, key: str) -> float | None:
        """Its median step's tokens (else samples) per second."""
        entrant = self.entrants.get(key)
        times = [t for t in (*entrant.select_s, *entrant.estimate_s) if t is not None] if entrant else []
        per_step = self.tokens_per_step or self.samples_per_step
        return per_step / statistics.median(times) if per_step and times else None

    def calibrated(self, trials: Mapping[str, float | None]) -> RaceResult:
        """This result with `trial_scale` from ``trials`` (fingerprint -> a trial's throughput)."""
        ratios = [trial / raced for k in self.entrants if (raced := self.throughput(k)) and (trial := trials.get(k))]
        return dataclasses.replace(self, trial_scale=min(ratios) if ratios else None)

    def tie_line(self) -> str | None:
        """``tie within noise: ...; chose ... (...)`` when the selection ended in a tie."""
        if len(self.tied) < 2 or self.winner is None:
            return None
        win = self.entrants[self.winner]
        others = [self.entrants[k] for k in self.tied if k != self.winner]
        peaks = [e.peak_bytes for e in others if e.peak_bytes is not None]
        if win.peak_bytes is not None and peaks and win.peak_bytes < min(peaks):
            why = "the most memory headroom"
        elif self.winner == self.leader:
            why = "the leader"
        else:
            same = [e for e in others if e.peak_bytes == win.peak_bytes]
            less = all(recompute_strength(win.short) < recompute_strength(e.short) for e in same)
            why = "the most memory headroom, then " + ("the least recomputation" if less else "the race's order")
        names = ", ".join(self.entrants[k].short for k in self.tied)
        return f"tie within noise between {names}; chose {win.short} ({why})"

    def unresolved_line(self) -> str | None:
        """``not separated ...`` when some entrants are unresolved."""
        if not self.unresolved or self.leader is None:
            return None
        lead = self.entrants[self.leader].short
        parts = [
            f"{self.entrants[k].short} {(1 / iv.ratio - 1) * 100:+.1f}% "
            f"({(1 / iv.high - 1) * 100:+.1f}..{(1 / iv.low - 1) * 100:+.1f}%)"
            for k in self.unresolved
            if (iv := self.behind.get(k)) is not None
        ]
        return (
            f"not separated from {lead} with confidence, nor seen within the tie margin of it: {', '.join(parts)}; "
            f"{lead} leads on its median"
        )

    def decision_lines(self) -> list[str]:
        return [line for line in (self.tie_line(), self.unresolved_line()) if line]

    def headlines(self) -> list[str]:
        """The winner against each reference: ``FFF... vs full FFFFFF: +6.1% (95% CI ...)``."""
        if self.winner is None:
            return []
        win = self.entrants[self.winner]
        refs = {k: self.entrants[k] for k in self.vs}
        return [
            f"{win.short} vs {refs[k].label} {refs[k].short}: {format_gain(iv, self.confidence)}"
            for k, iv in self.vs.items()
        ]

    def to_dict(self) -> dict[str, Any]:
        """Plain types (JSON-ready); `from_dict` of it is an equal result."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RaceResult:
        """The inverse of `to_dict`; keys older records carry and this one does not are ignored."""
        values = _fields(cls, data)
        values["entrants"] = {k: RaceEntrant(**_fields(RaceEntrant, e)) for k, e in values.get("entrants", {}).items()}
        for name in ("behind", "vs"):
            values[name] = {k: Interval(**_fields(Interval, v)) for k, v in values.get(name, {}).items()}
        return cls(**values)

    @classmethod
    def from_worker(
        cls,
        res: Mapping[str, Any],
        labels: Mapping[str, Sequence[str]],
        policies: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> RaceResult:
        """A race worker's payload (`to_dict`) with each entrant's labels and policy (fingerprint -> dict)."""
        race = cls.from_dict(res)
        policies = policies or {}
        entrants = {
            k: dataclasses.replace(
                e, labels=tuple(labels.get(k, ())), policy=dict(policies[k]) if k in policies else e.policy
            )
            for k, e in race.entrants.items()
        }
        return dataclasses.replace(race, entrants=entrants)


def _fields(cls: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    """``data``'s keys that are fields of the dataclass ``cls``, lists as tuples (JSON has no tuples)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in cls.__dataclass_fields__}
