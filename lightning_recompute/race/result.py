"""What a race found, as the parent reads it: the winner, the tie, and figures with their intervals."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_recompute.race.schedule import Stop
from lightning_recompute.race.stats import Interval

__all__ = ["RaceEntrant", "RaceResult", "format_gain"]

RaceOutcome = Literal["ok", "failed", "skipped"]


@dataclass(frozen=True)
class RaceEntrant:
    """One policy in a race."""

    key: str
    short: str
    labels: tuple[str, ...]
    """Why it raced: ``trial 12``, ``planner``, ``baseline full``, ``good`` ..."""
    peak_bytes: int | None = None
    out: str | None = None
    """Why it left the race (over the limit), or ``None``."""
    dropped: str | None = None
    """Why the selection stopped racing it (beaten with confidence), or ``None``."""
    select_s: tuple[float | None, ...] = ()
    """Its time per selection round (``None``: not run that round)."""
    estimate_s: tuple[float | None, ...] = ()
    policy: dict[str, Any] | None = None
    """Its policy (`RecomputePolicy.to_dict`), so a reader can run it again; ``None`` in older records."""

    def median_s(self) -> float | None:
        times = [t for t in (*self.select_s, *self.estimate_s) if t is not None]
        return statistics.median(times) if times else None

    @property
    def label(self) -> str:
        return " = ".join(self.labels) if self.labels else self.key


def format_gain(interval: Interval) -> str:
    """``+6.1% (95% CI +4.8..+7.3%, interleaved, 14 rounds)`` for a time ratio ``reference / winner``."""
    gain, low, high = interval.gain()
    return (
        f"{gain * 100:+.1f}% ({interval.confidence:.0%} CI {low * 100:+.1f}..{high * 100:+.1f}%, "
        f"interleaved, {interval.rounds} rounds)"
    )


@dataclass(frozen=True)
class RaceResult:
    """A race's outcome: ``ok`` with a winner, or why there was none."""

    outcome: RaceOutcome
    """``ok``, ``failed`` or ``skipped`` (``reason`` says why)."""
    reason: str | None = None
    entrants: dict[str, RaceEntrant] = field(default_factory=dict)
    winner: str | None = None
    """Key of the entrant chosen: the leader, or of those tied with it the most headroom, then least recomputation."""
    leader: str | None = None
    """Key of the fastest entrant by the selection rounds."""
    tied: tuple[str, ...] = ()
    """The leader and every entrant within noise of it."""
    unresolved: tuple[str, ...] = ()
    """Entrants neither separated from the leader nor within the tie margin of it."""
    behind: dict[str, Interval] = field(default_factory=dict)
    """Selection: each entrant's time over the leader's."""
    vs: dict[str, Interval] = field(default_factory=dict)
    """Estimation: each reference's time over the winner's (above 1: the winner is faster)."""
    stop: str = ""
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
    """The lowest ratio of a trial's throughput (own process) to its race throughput, over entrants that
    also ran as trials; ``None``: no entrant had a trial.
    """

    @property
    def ok(self) -> bool:
        return self.outcome == "ok" and self.winner is not None

    @property
    def unit(self) -> str:
        return "tokens/s" if self.tokens_per_step else "samples/s"

    def throughput(self, key: str) -> float | None:
        entrant = self.entrants.get(key)
        per_step = self.tokens_per_step or self.samples_per_step
        t = entrant.median_s() if entrant is not None else None
        return per_step / t if per_step and t else None

    def calibrated(self, trials: Mapping[str, float | None]) -> RaceResult:
        """This result with `trial_scale` from ``trials`` (fingerprint -> a trial's throughput)."""
        ratios = []
        for key in self.entrants:
            raced, trial = self.throughput(key), trials.get(key)
            if raced and trial:
                ratios.append(trial / raced)
        return dataclasses.replace(self, trial_scale=min(ratios) if ratios else None)

    def is_tie(self) -> bool:
        return len(self.tied) > 1

    def tie_line(self) -> str | None:
        """``tie within noise: ...; chose ... (...)`` when the selection ended in a tie."""
        if not self.is_tie() or self.winner is None:
            return None
        from lightning_recompute.race.rule import recompute_strength

        chose = self.winner
        names = ", ".join(self.entrants[k].short for k in self.tied)
        win = self.entrants[chose]
        others = [self.entrants[k] for k in self.tied if k != chose]
        peaks = [e.peak_bytes for e in others if e.peak_bytes is not None]
        if win.peak_bytes is not None and peaks and win.peak_bytes < min(peaks):
            why = "the most memory headroom"
        elif chose == self.leader:
            why = "the leader"
        else:
            same = [e for e in others if e.peak_bytes == win.peak_bytes]
            less = all(recompute_strength(win.short) < recompute_strength(e.short) for e in same)
            why = "the most memory headroom, then " + ("the least recomputation" if less else "the race's order")
        return f"tie within noise between {names}; chose {win.short} ({why})"

    def unresolved_line(self) -> str | None:
        """``not separated ...`` when some entrants are unresolved."""
        if not self.unresolved or self.leader is None:
            return None
        lead = self.entrants[self.leader].short
        parts = []
        for k in self.unresolved:
            iv = self.behind.get(k)
            if iv is not None:
                parts.append(
                    f"{self.entrants[k].short} {(1 / iv.ratio - 1) * 100:+.1f}% "
                    f"({(1 / iv.high - 1) * 100:+.1f}..{(1 / iv.low - 1) * 100:+.1f}%)"
                )
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
        lines = []
        for key, iv in self.vs.items():
            ref = self.entrants[key]
            lines.append(f"{win.short} vs {ref.label} {ref.short}: {format_gain(iv)}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        """Plain types (JSON-ready); `from_dict` of it is an equal result."""
        d = dataclasses.asdict(self)
        d["behind"] = {k: v.to_dict() for k, v in self.behind.items()}
        d["vs"] = {k: v.to_dict() for k, v in self.vs.items()}
        d["entrants"] = {
            k: {
                **dataclasses.asdict(e),
                "labels": list(e.labels),
                "select_s": list(e.select_s),
                "estimate_s": list(e.estimate_s),
            }
            for k, e in self.entrants.items()
        }
        d["tied"] = list(self.tied)
        d["unresolved"] = list(self.unresolved)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RaceResult:
        """The inverse of `to_dict`; unknown keys (from older records) are ignored."""
        values = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        values["entrants"] = {
            k: RaceEntrant(
                **{
                    **e,
                    "labels": tuple(e.get("labels", ())),
                    "select_s": tuple(e.get("select_s", ())),
                    "estimate_s": tuple(e.get("estimate_s", ())),
                }
            )
            for k, e in data.get("entrants", {}).items()
        }
        values["behind"] = {k: Interval.from_dict(v) for k, v in data.get("behind", {}).items()}
        values["vs"] = {k: Interval.from_dict(v) for k, v in data.get("vs", {}).items()}
        values["tied"] = tuple(data.get("tied", ()))
        values["stopped"] = Stop(data["stopped"]) if data.get("stopped") else None
        values["unresolved"] = tuple(data.get("unresolved", ()))
        return cls(**values)

    @classmethod
    def from_worker(
        cls,
        res: Mapping[str, Any],
        labels: Mapping[str, Sequence[str]],
        policies: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> RaceResult:
        """The result of a race's worker payload, with each entrant's labels and policy (fingerprint -> dict)."""
        sel, est = res.get("selection", {}), res.get("estimate", {})
        entrants = {
            k: RaceEntrant(
                key=k,
                short=str(e["short"]),
                labels=tuple(labels.get(k, ())),
                peak_bytes=e.get("peak_bytes"),
                out=e.get("out"),
                dropped=e.get("dropped"),
                select_s=tuple(e.get("select_s", ())),
                estimate_s=tuple(e.get("estimate_s", ())),
                policy=dict(policies[k]) if policies is not None and k in policies else None,
            )
            for k, e in res.get("entrants", {}).items()
        }
        return cls(
            outcome="ok",
            entrants=entrants,
            winner=sel.get("winner"),
            leader=sel.get("leader") or sel.get("winner"),
            tied=tuple(sel.get("tied", ())),
            unresolved=tuple(sel.get("unresolved", ())),
            behind={k: Interval.from_dict(v) for k, v in sel.get("behind", {}).items()},
            vs={k: Interval.from_dict(v) for k, v in est.get("vs", {}).items()},
            stop=str(sel.get("stop", "")),
            stopped=Stop(sel["stopped"]) if sel.get("stopped") else None,
            select_rounds=int(sel.get("rounds", 0)),
            estimate_rounds=int(est.get("rounds", 0)),
            tokens_per_step=res.get("tokens_per_step"),
            samples_per_step=res.get("samples_per_step"),
            wall_s=float(res.get("wall_s", 0.0)),
            machine_before=dict(res.get("machine_before", {})),
            machine_after=dict(res.get("machine_after", {})),
        )
