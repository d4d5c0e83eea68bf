"""What a race found, as the parent reads it: the winner, the tie, and figures with their intervals."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_recompute.race.schedule import Stop
from lightning_recompute.race.stats import Interval, across_processes, paired_ratio

__all__ = ["RaceEntrant", "RaceResult", "format_gain"]

RaceOutcome = Literal["ok", "failed", "skipped"]


@dataclass(frozen=True)
class RaceEntrant:
    """One policy in a race."""

    key: str
    """The entrant's key (its policy's fingerprint)."""
    short: str
    """Its glyphs, one per layer."""
    labels: tuple[str, ...]
    """Why it raced: ``trial 12``, ``planner``, ``baseline full``, ``good`` ..."""
    peak_bytes: int | None = None
    """The highest peak metered in the race."""
    out: str | None = None
    """Why it left the race (over the limit), or ``None``."""
    dropped: str | None = None
    """Why the selection stopped racing it (beaten with confidence), or ``None``."""
    select_s: tuple[float | None, ...] = ()
    """Its time per selection round (median of its timed steps there; ``None``: not run that round)."""
    estimate_s: tuple[float | None, ...] = ()
    """Its time per estimation round."""
    policy: dict[str, Any] | None = None
    """Its policy (`RecomputePolicy.to_dict`), so a reader can run it again (the gate re-measures a
    reference beside a slow confirmation); ``None`` in records written before it was kept."""

    def median_s(self) -> float | None:
        """Median of its round times over both phases, or ``None`` if it ran none."""
        times = [t for t in (*self.select_s, *self.estimate_s) if t is not None]
        return statistics.median(times) if times else None

    @property
    def label(self) -> str:
        """Its labels in one string (``trial 3 = baseline full``)."""
        return " = ".join(self.labels) if self.labels else self.key


def format_gain(interval: Interval) -> str:
    """``+6.1% (95% CI +4.8..+7.3%, interleaved, 14 rounds)`` for a time ratio ``reference / winner``;
    ``..., 28 rounds in 2 processes)`` when measured in several (`lightning_recompute.race.stats.across_processes`)."""
    gain, low, high = interval.gain()
    where = f" in {interval.processes} processes" if interval.processes > 1 else ""
    return (
        f"{gain * 100:+.1f}% ({interval.confidence:.0%} CI {low * 100:+.1f}..{high * 100:+.1f}%, "
        f"interleaved, {interval.rounds} rounds{where})"
    )


@dataclass(frozen=True)
class RaceResult:
    """A race's outcome: ``ok`` with a winner, or why there was none."""

    outcome: RaceOutcome
    """``ok``, ``failed`` (the worker failed; the reason says how) or ``skipped`` (not raced; the reason says why)."""
    reason: str | None = None
    entrants: dict[str, RaceEntrant] = field(default_factory=dict)
    winner: str | None = None
    """Key of the entrant chosen: the leader, or of those tied with it the one with the most headroom,
    then the least recomputation; or a rival faster across processes (`selected` is then the selection's)."""
    leader: str | None = None
    """Key of the fastest entrant by the selection rounds (may differ from `winner` within a tie)."""
    tied: tuple[str, ...] = ()
    """The leader and every entrant within noise of it (`lightning_recompute.race.rule.Standing.tied`)."""
    unresolved: tuple[str, ...] = ()
    """Entrants the selection could neither separate from the leader nor see within the tie margin of it
    (`lightning_recompute.race.rule.Standing.unresolved`): the leader won the selection over them on its better median
    (they may race again: `rivals`)."""
    behind: dict[str, Interval] = field(default_factory=dict)
    """Selection: each entrant's time over the leader's."""
    vs: dict[str, Interval] = field(default_factory=dict)
    """Estimation: each reference's time over the winner's (above 1: the winner is faster); across every
    process the estimation ran in (`estimated_again`)."""
    vs_processes: tuple[dict[str, Interval], ...] = ()
    """Each estimation process's own `vs`, the race's process first, or after a rival won only the fresh
    processes that measured it (empty: only the race's process)."""
    rechecked: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Rivals raced again beside the selection's winner in the fresh estimation processes
    (`estimated_again`): each one's time over that winner's, one figure per process that measured the pair
    in at least 2 rounds, in the order measured, the race's process first (empty: none raced again)."""
    selected: str | None = None
    """The selection's winner in the race's own process, when the rivals' race across processes chose
    another (`winner`); ``None``: the selection's winner stands."""
    stop: str = ""
    """Why the selection stopped, in words with the figures."""
    stopped: Stop | None = None
    """Why the selection stopped (``None``: no race ran, or a record older than the field)."""
    select_rounds: int = 0
    estimate_rounds: int = 0
    tokens_per_step: int | None = None
    samples_per_step: int | None = None
    wall_s: float = 0.0
    machine_before: dict[str, Any] = field(default_factory=dict)
    machine_after: dict[str, Any] = field(default_factory=dict)
    trial_scale: float | None = None
    """How low a trial in its own process measures against the race on the same policies: the lowest,
    over entrants that also ran as trials, of trial throughput over race throughput (a short-lived
    process is slower than a warm one, more so for small models and on a loaded machine, and the
    lowest is what a separate run of a policy that truly is as fast as raced can come out at).
    ``None``: no entrant had a trial."""

    # ---------------------------------------------------------------- reading

    @property
    def ok(self) -> bool:
        return self.outcome == "ok" and self.winner is not None

    @property
    def unit(self) -> str:
        return "tokens/s" if self.tokens_per_step else "samples/s"

    def throughput(self, key: str) -> float | None:
        """An entrant's throughput from its median round time (``None``: not measured)."""
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
        """More than one entrant within noise of the leader."""
        return len(self.tied) > 1

    def tie_line(self) -> str | None:
        """``tie within noise: ...; chose ... (...)`` when the selection ended in a tie."""
        if not self.is_tie() or self.winner is None:
            return None
        from lightning_recompute.race.rule import recompute_strength

        chose = self.selected or self.winner  # the tie was the selection's; a rival may have won since
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
        """``not separated ...`` when entrants were neither beaten with confidence nor seen within the tie
        margin of the leader."""
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

    def rivals(self, limit: int) -> list[str]:
        """Up to ``limit`` entrants to race again beside the winner in a fresh process: those the
        selection left unresolved (`unresolved`), closest to the leader first.

        One process's rounds share its memory layout and where the scheduler put it, and on this
        project's machine two policies 3% apart swapped order from one process to the next; an
        unresolved entrant lost on one process's median, which such an effect can decide.
        """
        if self.winner is None:
            return []
        alive = [k for k in self.unresolved if k in self.entrants and self.entrants[k].out is None and k != self.winner]
        alive.sort(key=lambda k: self.behind[k].ratio if k in self.behind else float("inf"))
        return alive[: max(0, limit)]

    def disputed(self) -> list[str]:
        """Rivals raced again (`rechecked`) that the processes so far cannot call: one process measured
        the rival faster than the selection's winner and another slower, and their geometric mean is within
        one standard error of parity (the log ratios' standard deviation over the root of their count).

        Two processes that disagree are always disputed; a third that sides clearly with one of them
        settles it, one near parity does not."""
        found = []
        for key, ratios in self.rechecked.items():
            logs = [math.log(r) for r in ratios]
            if min(logs) < 0.0 < max(logs):
                error = statistics.stdev(logs) / math.sqrt(len(logs))
                if abs(statistics.fmean(logs)) < error:
                    found.append(key)
        return found

    def recheck_line(self) -> str | None:
        """``raced again in fresh processes, vs FF.. (...): Fs.. -1.2% in 2 processes (+0.8%, -3.1%); FF..
        stays the winner`` after the rivals raced again (`estimated_again`); ``None`` when none did."""
        if not self.rechecked or self.winner is None:
            return None
        first = self.selected or self.winner
        base = self.entrants[first].short
        parts = []
        for key, ratios in self.rechecked.items():
            each = ", ".join(f"{(1 / r - 1) * 100:+.1f}%" for r in ratios)
            n = len(ratios)
            parts.append(
                f"{self.entrants[key].short} {(1 / _geomean(ratios) - 1) * 100:+.1f}% in {n} processes ({each})"
            )
        end = (
            f"{self.entrants[self.winner].short} is faster across them and wins over {base}"
            if self.selected is not None
            else f"{base} stays the winner"
        )
        figures = ", ".join(parts)
        return f"raced again in fresh processes, vs {base} (each process's figure): {figures}; {end}"

    def decision_lines(self) -> list[str]:
        """What decided the winner, in words: the tie, the unresolved entrants, the rivals raced again."""
        return [line for line in (self.tie_line(), self.unresolved_line(), self.recheck_line()) if line]

    def headlines(self) -> list[str]:
        """The winner against each reference: ``FFF... vs full FFFFFF: +6.1% (95% CI ..., interleaved, 14 rounds)``."""
        if self.winner is None:
            return []
        win = self.entrants[self.winner]
        lines = []
        for key, iv in self.vs.items():
            ref = self.entrants[key]
            lines.append(f"{win.short} vs {ref.label} {ref.short}: {format_gain(iv)}")
        return lines

    def estimated_again(
        self,
        others: Sequence[RaceResult],
        *,
        rivals: Sequence[str] = (),
        references: Sequence[str] = (),
        confidence: float = 0.95,
    ) -> RaceResult:
        """This result with its `vs` figures measured in more processes, and its ``rivals`` raced again.

        ``others`` are races of the same winner with no selection (`tuner._trials.run_race` given
        ``winner``), against the same references and beside the ``rivals`` (`rivals`); failed ones, and
        races of another winner, add nothing. ``references``: the keys the figures are about (the race's
        field's references; default: those `vs` has).

        - **The rivals**: each one's time over the winner's per process (in the race's process from the
          selection rounds both ran, in the others from their rounds) is combined by the geometric mean
          over processes, so a process's own effect weighs on one term of several rather than on the
          whole decision. A rival faster on that mean, measured in at least two processes, becomes the
          `winner` (the fastest such), and `selected` keeps the selection's.
        - **The figures.** For the selection's winner a reference gets the hull of every process's
          interval (`lightning_recompute.race.stats.across_processes`); one a process could not measure keeps the
          processes that did. For a rival that won, the race's own rounds were a selection, so its figures
          come from the others' rounds only (`refigured`; the selection's winner among the references
          when it is one).
        """
        same = [o for o in others if o.ok and o.winner == self.winner]
        if not same or self.winner is None:
            return self
        rechecked: dict[str, tuple[float, ...]] = {}
        for key in rivals:
            if key == self.winner or not any(key in o.entrants and o.entrants[key].estimate_s for o in same):
                continue  # not raced again
            measured = [_ratio(self, key, "select_s"), *(_ratio(o, key, "estimate_s") for o in same)]
            ratios = tuple(r for r in measured if r is not None)
            if len(ratios) >= 2:
                rechecked[key] = ratios
        faster = {k: _geomean(r) for k, r in rechecked.items() if _geomean(r) < 1.0}
        if faster:
            new = min(faster, key=lambda k: faster[k])
            won = dataclasses.replace(
                self, winner=new, selected=self.winner, rechecked=rechecked, vs={}, vs_processes=()
            )
            # Only the processes that raced the references: a dispute's process chose, it measured no figure.
            with_figures = [o for o in same if o.vs]
            return won.refigured(with_figures, references=list(references or self.vs), confidence=confidence)
        per_process = [dict(self.vs), *(dict(o.vs) for o in same if o.vs)]  # a dispute's process has no figure
        vs = {key: across_processes([p[key] for p in per_process if key in p]) for key in self.vs}
        return dataclasses.replace(self, vs=vs, vs_processes=tuple(per_process), rechecked=rechecked)

    def refigured(self, others: Sequence[RaceResult], *, references: Sequence[str], confidence: float) -> RaceResult:
        """This result with the winner's figures against ``references`` from the rounds ``others`` ran
        (estimation processes that raced the winner beside them) added to its own `vs_processes`. A process
        where a reference ran beside the winner in fewer than 2 rounds adds no figure for it."""
        assert self.winner is not None
        per_process = list(self.vs_processes)
        for o in others:
            measured = {}
            for ref in references:
                iv = _paired(o, self.winner, ref, confidence) if o.ok and ref != self.winner else None
                if iv is not None:
                    measured[ref] = iv
            if measured:
                per_process.append(measured)
        keys = dict.fromkeys(k for p in per_process for k in p)
        vs = {k: across_processes([p[k] for p in per_process if k in p]) for k in keys}
        return dataclasses.replace(self, vs=vs, vs_processes=tuple(per_process))

    # ---------------------------------------------------------------- conversion

    def to_dict(self) -> dict[str, Any]:
        """Plain types (JSON-ready); `from_dict` of it is an equal result."""
        d = dataclasses.asdict(self)
        d["behind"] = {k: v.to_dict() for k, v in self.behind.items()}
        d["vs"] = {k: v.to_dict() for k, v in self.vs.items()}
        d["vs_processes"] = [{k: v.to_dict() for k, v in p.items()} for p in self.vs_processes]
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
        d["rechecked"] = {k: list(v) for k, v in self.rechecked.items()}
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RaceResult:
        values = dict(data)
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
        values["behind"] = {k: Interval(**v) for k, v in data.get("behind", {}).items()}
        values["vs"] = {k: Interval(**v) for k, v in data.get("vs", {}).items()}
        values["vs_processes"] = tuple({k: Interval(**v) for k, v in p.items()} for p in data.get("vs_processes", ()))
        values["tied"] = tuple(data.get("tied", ()))
        values["stopped"] = Stop(data["stopped"]) if data.get("stopped") else None
        values["unresolved"] = tuple(data.get("unresolved", ()))
        values["rechecked"] = {k: tuple(v) for k, v in data.get("rechecked", {}).items()}
        return cls(**values)

    @classmethod
    def from_worker(
        cls,
        res: Mapping[str, Any],
        labels: Mapping[str, Sequence[str]],
        policies: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> RaceResult:
        """The result of `lightning_recompute.race.engine.race` (the worker's payload), with each entrant's labels and
        its policy (fingerprint -> `RecomputePolicy.to_dict`)."""
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
            behind={k: Interval(**v) for k, v in sel.get("behind", {}).items()},
            vs={k: Interval(**v) for k, v in est.get("vs", {}).items()},
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


def _geomean(ratios: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(r) for r in ratios))


def _pairs(race: RaceResult, a: str, b: str, phase: str) -> tuple[list[float], list[float]]:
    """``a``'s and ``b``'s times in the rounds of ``phase`` (``select_s``/``estimate_s``) both ran."""
    ea, eb = race.entrants.get(a), race.entrants.get(b)
    if ea is None or eb is None:
        return [], []
    both = [(x, y) for x, y in zip(getattr(ea, phase), getattr(eb, phase), strict=False) if x and y]
    return [x for x, _ in both], [y for _, y in both]


def _ratio(race: RaceResult, key: str, phase: str) -> float | None:
    """``key``'s time over ``race``'s winner's: the median over the rounds of ``phase`` both ran (``None``:
    fewer than 2)."""
    if race.winner is None:
        return None
    mine, its = _pairs(race, race.winner, key, phase)
    return paired_ratio(mine, its).ratio if len(mine) >= 2 else None


def _paired(race: RaceResult, winner: str, ref: str, confidence: float) -> Interval | None:
    """``ref``'s time over ``winner``'s in ``race``'s estimation rounds, with its interval (``None``: fewer than 2)."""
    mine, its = _pairs(race, winner, ref, "estimate_s")
    return paired_ratio(mine, its, confidence=confidence) if len(mine) >= 2 else None
