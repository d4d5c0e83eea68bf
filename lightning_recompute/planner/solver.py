"""`Planner`: a policy's predicted peak is the largest level met walking the profile's segments in order; each is
a constant plus a prefix sum of kept bytes, so a dynamic programme over layers keeping the non-dominated (kept
bytes, time) states is exact. Ties: fastest, then least memory, then mode order."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from lightning_recompute.errors import RecomputeError
from lightning_recompute.policy import Mode, PolicyLike, RecomputePolicy, glyph
from lightning_recompute.profile import ALL_MODES, Profile, SegmentCost
from lightning_recompute.profile.model import ZERO_GRAD_SEGMENT
from lightning_recompute.sources import as_policy
from lightning_recompute.units import format_bytes, format_seconds, parse_bytes


class PlannerError(RecomputeError, ValueError):
    """Invalid input to the planner (a budget string, a mode, a micro-batch, a profile)."""


class BudgetError(PlannerError):
    """No policy fits the memory budget; the message states the least achievable peak."""

    def __init__(self, message: str, *, budget_bytes: int, min_peak_bytes: int) -> None:
        super().__init__(message)
        self.budget_bytes, self.min_peak_bytes = budget_bytes, min_peak_bytes


@dataclass(frozen=True)
class LayerPrediction:
    """One layer's share of a prediction."""

    name: str
    mode: str
    kept_bytes: int  # activation bytes kept from forward to backward, its output included
    forward_seconds: float
    backward_seconds: float
    recompute_flops: int
    backward_peak_bytes: int


@dataclass(frozen=True)
class Prediction:
    """Predicted peak memory and step time of one policy at one micro-batch."""

    peak_bytes: int
    step_time_s: float
    micro_batch: int
    peak_at: str  # the segment key where the peak is reached (``bwd:0``)
    base_bytes: int  # memory held before the step starts (batch scaled)
    layers: tuple[LayerPrediction, ...]
    estimated: bool  # time from FLOPs and a hardware table rather than measurement

    def figures(self) -> dict[str, float | int]:
        """The figures a trial records as ``predicted_*`` (``peak_bytes``, ``step_time_s``)."""
        return {"peak_bytes": self.peak_bytes, "step_time_s": self.step_time_s}

    def describe(self) -> str:
        # Columns at least two characters wider than their longest entry.
        name_w = max(18, max((len(lp.name) for lp in self.layers), default=0) + 2)
        mode_w = max(10, max((len(lp.mode) for lp in self.layers), default=0) + 2)
        lines = [
            f"predicted peak {format_bytes(self.peak_bytes)} (at {self.peak_at}), step "
            f"{format_seconds(self.step_time_s)}{' (estimated)' if self.estimated else ''},"
            f" micro-batch {self.micro_batch}",
            f"{'layer':<{name_w}}{'mode':<{mode_w}}{'kept':>12}{'fwd':>11}{'bwd':>11}{'recompute':>14}{'bwd peak':>12}",
        ]
        for lp in self.layers:
            lines.append(
                f"{lp.name:<{name_w}}{lp.mode:<{mode_w}}{format_bytes(lp.kept_bytes):>12}"
                f"{format_seconds(lp.forward_seconds):>11}"
                f"{format_seconds(lp.backward_seconds):>11}{lp.recompute_flops / 1e9:>10.3f} GF"
                f"{format_bytes(lp.backward_peak_bytes):>12}"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class PlannedPolicy:
    """A policy with its prediction."""

    policy: RecomputePolicy
    modes: Mapping[str, str]
    prediction: Prediction

    @property
    def peak_bytes(self) -> int:
        return self.prediction.peak_bytes

    @property
    def step_time_s(self) -> float:
        return self.prediction.step_time_s

    def short(self) -> str:
        """One character per layer (`lightning_recompute.policy.glyph`)."""
        return "".join(glyph(m) for m in self.modes.values())


@dataclass
class Tables:
    """The profile at one micro-batch and mode set, as integers (bytes; time in nanoseconds)."""

    modes: list[str]
    a: np.ndarray  # (L, M) kept bytes
    f: np.ndarray  # (L, M) forward transient
    b: np.ndarray  # (L, M) backward transient
    t: np.ndarray  # (L, M) forward + backward nanoseconds
    fwd_c: np.ndarray  # (L,) constant of the forward constraint of layer i (plus A_{<i})
    bwd_c: np.ndarray  # (L,) constant of the backward constraint of layer i (plus A_{<=i})
    fixed_c: np.ndarray  # (L+1,) largest constant of fixed-segment constraints over A_{<p}; -inf-like if none


def _frontier(tab: Tables, budget: int, by_peak: bool) -> tuple[np.ndarray, np.ndarray, list[tuple[np.ndarray, ...]]]:
    """The DP over layers: non-dominated states ``(A, cost)`` within ``budget``, with back-pointers; the cost is
    the time so far, or with ``by_peak`` the peak so far."""
    n, nm = tab.a.shape
    A = np.zeros(1, np.int64)
    V = np.array([tab.fixed_c[0] if by_peak else 0], np.int64)
    parents: list[tuple[np.ndarray, ...]] = []
    for i in range(n + 1):
        pre = tab.fixed_c[i] + A
        idx = np.nonzero(pre <= budget)[0]
        A, V = A[idx], np.maximum(V[idx], pre[idx]) if by_peak else V[idx]
        if parents:  # fold the filter into the previous layer's back-pointers
            parents[-1] = (parents[-1][0][idx], parents[-1][1][idx])
        if i == n or A.size == 0:
            break
        cands = []
        for j in range(nm):
            a2 = A + tab.a[i, j]
            c = np.maximum(tab.fwd_c[i] + A + tab.f[i, j], tab.bwd_c[i] + a2 + tab.b[i, j])
            sel = np.nonzero(c <= budget)[0]
            cost = np.maximum(V[sel], c[sel]) if by_peak else V[sel] + tab.t[i, j]
            cands.append((a2[sel], cost, sel, np.full(sel.size, j, np.int64)))
        A, V, P, M = (np.concatenate(x) for x in zip(*cands, strict=True))
        order = np.lexsort((V, A))  # by A, then cost; stable, so generation order breaks exact ties
        A, V, P, M = A[order], V[order], P[order], M[order]
        keep = np.ones(A.size, bool)
        keep[1:] = V[1:] < np.minimum.accumulate(V)[:-1]  # strictly cheaper than every state with no more memory
        A, V = A[keep], V[keep]
        parents.append((P[keep], M[keep]))
    return A, V, parents


def fastest_within(tab: Tables, budget: int) -> list[int] | None:
    """Least-time mode indices with every constraint <= budget, or None."""
    A, _, parents = _frontier(tab, budget, by_peak=False)
    if A.size == 0:
        return None
    # States are sorted by A with T strictly decreasing, so the last feasible one is the fastest.
    k = A.size - 1
    picks = []
    for P, M in reversed(parents):
        picks.append(int(M[k]))
        k = int(P[k])
    return picks[::-1]


def least_peak(tab: Tables) -> int:
    """The least predicted peak: the same DP with the running maximum as the cost."""
    return int(np.min(_frontier(tab, np.iinfo(np.int64).max, by_peak=True)[1]))


def pareto_picks(tab: Tables) -> list[list[int]]:
    """Mode indices of every Pareto-optimal (peak, time) policy, by increasing peak."""
    n, nm = tab.a.shape
    a, f, b, t = tab.a.tolist(), tab.f.tolist(), tab.b.tolist(), tab.t.tolist()
    # A state: (A, P, T, parent index, mode); states of a layer sorted by A.
    states: list[tuple[int, int, int, int, int]] = [(0, int(tab.fixed_c[0]), 0, -1, -1)]
    history: list[list[tuple[int, int, int, int, int]]] = []
    stair_p: list[int]
    stair_t: list[int]
    for i in range(n):
        fixed, fc, bc = int(tab.fixed_c[i]), int(tab.fwd_c[i]), int(tab.bwd_c[i])
        cands = []
        for j in range(nm):
            aj, fj, bj, tj = a[i][j], f[i][j], b[i][j], t[i][j]
            for s, (A, P, T, _, _) in enumerate(states):
                A2 = A + aj
                P2 = max(P, fixed + A, fc + A + fj, bc + A2 + bj)
                cands.append((A2, P2, T + tj, s, j))
        cands.sort(key=lambda c: (c[0], c[1], c[2]))  # stable: generation order breaks exact ties
        history.append(states)
        # The (A, P, T)-non-dominated candidates: each checked by a bisect on the staircase of earlier (P, T).
        states, stair_p, stair_t = [], [], []  # the staircase: P increasing, T decreasing
        for c in cands:
            pos = bisect.bisect_right(stair_p, c[1])
            if pos > 0 and stair_t[pos - 1] <= c[2]:
                continue
            states.append(c)
            end = pos
            while end < len(stair_p) and stair_t[end] >= c[2]:
                end += 1
            stair_p[pos:end], stair_t[pos:end] = [c[1]], [c[2]]
    history.append(states)
    end = int(tab.fixed_c[n])
    finals = sorted(((max(P, end + A), T, s) for s, (A, P, T, _, _) in enumerate(states)), key=lambda x: (x[0], x[1]))
    out, best_t = [], None
    for _, T, s in finals:
        if best_t is not None and best_t <= T:
            continue
        best_t, picks = T, []
        for layer in range(n, 0, -1):
            _, _, _, s, mode = history[layer][s]
            picks.append(mode)
        out.append(picks[::-1])
    return out


_NEG = np.iinfo(np.int64).min // 4


class Planner:
    """Predicts and optimises policies for the model a `Profile` describes."""

    def __init__(self, profile: Profile, free_grads_at_batch_start: bool | None = None) -> None:
        """``free_grads_at_batch_start``: predict a job that frees gradients at batch start; ``None``: as profiled."""
        if not isinstance(profile, Profile):
            raise PlannerError(f"profile: expected a lightning_recompute.profile.Profile, got {type(profile).__name__}")
        self.profile, self.names, n = profile, profile.layer_names, len(profile.layers)
        missing = [k for k in profile.timeline if k.startswith("fixed:") and k[len("fixed:") :] not in profile.fixed]
        if missing:
            raise PlannerError(f"profile: timeline names fixed segment(s) {missing}, which the profile lacks")
        # The solver's prefix-sum form needs forward in order and backward in reverse.
        order = [f"fwd:{i}" for i in range(n)] + [f"bwd:{i}" for i in reversed(range(n))]
        if [k for k in profile.timeline if not k.startswith("fixed:")] != order:
            raise PlannerError(
                "profile: its timeline must hold every layer's forward in order, then their backwards in reverse"
            )
        frees = profile.free_grads_at_batch_start if free_grads_at_batch_start is None else free_grads_at_batch_start
        if frees and profile.forward_grad_bytes is None:
            raise PlannerError(
                f"free_grads_at_batch_start: the profile has no {ZERO_GRAD_SEGMENT!r} segment (it predates it), so "
                f"the gradients alive in the forward are unknown; profile again"
            )
        # Freed at batch start, the gradients leave the base level and zero_grad's segment frees nothing.
        self._freed_grads = (profile.forward_grad_bytes or 0) if frees else 0

    def _modes(self, modes: Sequence[str] | None) -> list[str]:
        """``modes`` (default: the profile's) in the canonical order, which breaks ties."""
        valid = self.profile.modes
        if modes is None:
            return [m for m in ALL_MODES if m in valid]
        out = [m.value if isinstance(m, Mode) else str(m).strip().lower() for m in modes]
        for m, name in zip(modes, out, strict=True):
            if name not in valid:
                raise PlannerError(f"modes: {m!r} is not in the profile; valid: {', '.join(valid)}")
        if not out:
            raise PlannerError(f"modes: empty; valid: {', '.join(valid)}")
        return [m for m in ALL_MODES if m in out]

    def _scale(self, micro_batch: int | None) -> tuple[int, float]:
        mb = self.profile.micro_batch if micro_batch is None else micro_batch
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
            raise PlannerError(f"micro_batch: must be a positive integer, got {micro_batch!r}")
        return mb, mb / self.profile.micro_batch

    @staticmethod
    def _seg(c: SegmentCost, k: float) -> tuple[int, int, float]:
        """(delta, peak, seconds) scaled by ``k``; gradients and static parts do not scale."""
        if k == 1.0 or not c.scales:
            return c.delta, c.peak, c.seconds
        g, sd, sp = c.grad, c.static_delta, c.static_peak
        delta = g + sd + round((c.delta - g - sd) * k)
        gp, act = max(0, g), c.peak - sp
        peak = sp + (gp + round((act - gp) * k) if act >= gp else round(act * k))
        return delta, max(peak, delta, 0), c.seconds * k

    def _fixed_seg(self, name: str, k: float) -> tuple[int, int, float]:
        """`_seg` of fixed segment ``name``; zero_grad frees nothing if the gradients went at batch start."""
        d, pk, s = self._seg(self.profile.fixed[name], k)
        if name == ZERO_GRAD_SEGMENT and self._freed_grads:
            d += self._freed_grads
            pk = max(pk, d)
        return d, pk, s

    def _net(self, i: int, k: float) -> int:
        layer = self.profile.layers[i]
        if k == 1.0:
            return layer.net
        fwd, bwd = layer.fwd[Mode.NONE.value], layer.bwd[Mode.NONE.value]
        g = fwd.grad + bwd.grad + fwd.static_delta + bwd.static_delta
        return g + round((layer.net - g) * k)

    def _base(self, k: float) -> int:
        return self.profile.base_bytes - self._freed_grads + round(self.profile.batch_bytes * (k - 1))

    def _tables(self, modes: Sequence[str] | None, micro_batch: int | None) -> tuple[Tables, int]:
        mlist, (mb, k) = self._modes(modes), self._scale(micro_batch)
        prof = self.profile
        n, nm = len(prof.layers), len(mlist)
        a, f, b, t = (np.zeros((n, nm), np.int64) for _ in range(4))
        for i, layer in enumerate(prof.layers):
            for j, m in enumerate(mlist):
                fd, fp, fs = self._seg(layer.fwd[m], k)
                _, bp, bs = self._seg(layer.bwd[m], k)
                a[i, j], f[i, j], b[i, j], t[i, j] = fd, fp, bp, round((fs + bs) * 1e9)
        net = np.array([self._net(i, k) for i in range(n)], np.int64)
        fwd_c, bwd_c = np.zeros(n, np.int64), np.zeros(n, np.int64)
        fixed_c = np.full(n + 1, _NEG, np.int64)
        fixed_c[0] = const = self._base(k)  # the level before the step is a candidate for the peak too
        p = 0  # the level is const + A_{<p}
        for key in prof.timeline:
            kind, _, rest = key.partition(":")
            if kind == "fixed":
                d, pk, _ = self._fixed_seg(rest, k)
                fixed_c[p] = max(fixed_c[p], const + pk)
                const += d
            elif kind == "fwd":
                fwd_c[int(rest)], p = const, int(rest) + 1
            else:  # layer i's backward starts at const + A_{<=i}; it leaves net_i in place of a_i
                bwd_c[int(rest)], p = const, int(rest)
                const += int(net[p])
        return Tables(mlist, a, f, b, t, fwd_c, bwd_c, fixed_c), mb

    def predict(self, policy: PolicyLike | Mapping[str, str], micro_batch: int | None = None) -> Prediction:
        """Predicted peak memory and step time of ``policy`` (anything `as_policy` takes, or a plain
        ``{layer path: mode}`` mapping) at ``micro_batch`` (default: the profiled one)."""
        if isinstance(policy, Mapping) and "version" not in policy:
            policy = RecomputePolicy.from_modes(policy)
        resolved = as_policy(policy).resolve_choices(self.names)
        modes = [resolved[n] for n in self.names]
        missing = sorted({m for m in modes if m not in self.profile.modes})
        if missing:
            raise PlannerError(
                f"policy: uses mode(s) {missing} that the profile did not measure;"
                f" profiled: {', '.join(self.profile.modes)}"
            )
        return self._predict(modes, self._scale(micro_batch)[0])

    def _predict(self, modes: list[str], mb: int) -> Prediction:
        """The timeline walk for resolved per-layer modes."""
        k, prof = mb / self.profile.micro_batch, self.profile
        level = base = self._base(k)
        peak, peak_at, total = level, "start", 0.0
        layers: dict[int, LayerPrediction] = {}
        for key in prof.timeline:
            kind, _, rest = key.partition(":")
            if kind == "fixed":
                d, pk, s = self._fixed_seg(rest, k)
            elif kind == "fwd":
                d, pk, s = self._seg(prof.layers[int(rest)].fwd[modes[int(rest)]], k)
            else:
                i = int(rest)
                layer, m = prof.layers[i], modes[i]
                fd, _, fs = self._seg(layer.fwd[m], k)
                _, pk, s = self._seg(layer.bwd[m], k)
                d = self._net(i, k) - fd
                flops = round(layer.recompute_flops(m) * k)
                layers[i] = LayerPrediction(layer.name, m, fd, fs, s, flops, level + pk)
            cand, level = level + pk, level + d
            total += round(s * 1e9)
            if cand > peak:
                peak, peak_at = cand, key
        ordered = tuple(layers[i] for i in range(len(modes)))
        return Prediction(int(peak), total / 1e9, mb, peak_at, base, ordered, prof.estimated)

    def solve(
        self, budget_bytes: int | str, modes: Sequence[str] | None = None, micro_batch: int | None = None
    ) -> PlannedPolicy:
        """The policy with the least predicted step time whose predicted peak is at most ``budget_bytes``;
        `BudgetError` (stating the least peak) where none is."""
        if isinstance(budget_bytes, int) and not isinstance(budget_bytes, bool):
            budget = budget_bytes  # as it is: a BudgetError names the least peak, which says more
        else:
            try:
                budget = parse_bytes(budget_bytes)
            except ValueError as err:
                raise PlannerError(f"budget_bytes: {err}") from None
        tab, mb = self._tables(modes, micro_batch)
        picks = fastest_within(tab, budget)
        if picks is None:
            least = least_peak(tab)
            raise BudgetError(
                f"budget {format_bytes(budget)} ({budget} bytes) is below the least achievable predicted peak "
                f"{format_bytes(least)} ({least} bytes) with modes {', '.join(tab.modes)} at micro-batch {mb}",
                budget_bytes=budget,
                min_peak_bytes=least,
            )
        return self._plan(tab, picks, mb)

    def min_peak(self, modes: Sequence[str] | None = None, micro_batch: int | None = None) -> int:
        """The least predicted peak any policy over ``modes`` reaches."""
        return least_peak(self._tables(modes, micro_batch)[0])

    def pareto_front(self, modes: Sequence[str] | None = None, micro_batch: int | None = None) -> list[PlannedPolicy]:
        """Every policy not beaten on both peak and step time, by increasing peak (decreasing time)."""
        tab, mb = self._tables(modes, micro_batch)
        return [self._plan(tab, picks, mb) for picks in pareto_picks(tab)]

    def _plan(self, tab: Tables, picks: list[int], mb: int) -> PlannedPolicy:
        modes = [tab.modes[j] for j in picks]
        mapping = dict(zip(self.names, modes, strict=True))
        return PlannedPolicy(RecomputePolicy.from_modes(mapping), mapping, self._predict(modes, mb))
