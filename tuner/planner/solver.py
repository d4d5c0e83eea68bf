"""The cost model and the exact solver (see `tuner.planner`): `Planner` predicts any policy's
peak and step time from a `Profile`, and finds the fastest policy under a budget and the Pareto front."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from lightning_recompute.errors import RecomputeError
from lightning_recompute.policy import Mode, PolicyLike, RecomputePolicy, glyph
from lightning_recompute.sources import as_policy
from tuner.profile import ALL_MODES, Profile, SegmentCost
from tuner.profile.model import ZERO_GRAD_SEGMENT
from tuner.units import format_bytes, format_seconds, parse_bytes


class PlannerError(RecomputeError, ValueError):
    """Invalid input to the planner (a budget string, a mode, a micro-batch, a profile)."""


class BudgetError(PlannerError):
    """No policy fits the memory budget; the message states the least achievable peak."""

    def __init__(self, message: str, *, budget_bytes: int, min_peak_bytes: int) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_peak_bytes = min_peak_bytes


# --------------------------------------------------------------------------- bytes


# --------------------------------------------------------------------------- results


def _budget_bytes(value: int | str) -> int:
    """A budget as bytes, or a `PlannerError` naming what is wrong.

    A whole number is taken as it is: a budget below every policy's peak (zero included) is a
    `BudgetError` with the least achievable peak, which says more than "not a size". Anything
    else is read by `tuner.units.parse_bytes`.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        return parse_bytes(value)
    except ValueError as err:
        raise PlannerError(f"budget_bytes: {err}") from None


@dataclass(frozen=True)
class LayerPrediction:
    """One layer's share of a prediction."""

    name: str
    mode: str
    kept_bytes: int
    """Activation bytes it keeps from forward to backward (its output included)."""
    forward_seconds: float
    backward_seconds: float
    """Backward time, recomputation included."""
    recompute_flops: int
    backward_peak_bytes: int
    """Predicted device memory at the highest point of this layer's backward."""


@dataclass(frozen=True)
class Prediction:
    """Predicted peak memory and step time of one policy at one micro-batch."""

    peak_bytes: int
    step_time_s: float
    micro_batch: int
    peak_at: str
    """Where the peak is reached: a segment key such as ``bwd:0`` (the backward of layer 0)."""
    base_bytes: int
    """Parameters, optimizer state, batch and buffers: memory held before the step starts (batch scaled)."""
    layers: tuple[LayerPrediction, ...]
    estimated: bool
    """True when time comes from FLOPs and a hardware table rather than measurement."""

    def figures(self) -> dict[str, float | int]:
        """The figures a trial records as ``predicted_*`` (``peak_bytes``, ``step_time_s``)."""
        return {"peak_bytes": self.peak_bytes, "step_time_s": self.step_time_s}

    def describe(self) -> str:
        # The name and mode columns at least two characters wider than their longest entry, so a long
        # name (``model.model.layers.0``) or mode (``selective:attn+narrow``) never runs into the next.
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
    """Mode per layer path, in layer order."""
    prediction: Prediction

    @property
    def peak_bytes(self) -> int:
        return self.prediction.peak_bytes

    @property
    def step_time_s(self) -> float:
        return self.prediction.step_time_s

    def short(self) -> str:
        """One character per layer (`lightning_recompute.policy.glyph`): ``.`` none, ``s`` selective,
        ``a``/``w``/``n`` selective:attn/attn+wide/attn+narrow, ``F`` full, ``o`` offload."""
        return "".join(glyph(m) for m in self.modes.values())


@dataclass
class _Tables:
    """The profile at one micro-batch and mode set, as integers (bytes; time in nanoseconds)."""

    modes: list[str]
    a: np.ndarray  # (L, M) kept bytes
    f: np.ndarray  # (L, M) forward transient
    b: np.ndarray  # (L, M) backward transient
    t: np.ndarray  # (L, M) forward + backward nanoseconds
    net: np.ndarray  # (L,)
    fwd_c: np.ndarray  # (L,) constant of the forward constraint of layer i (plus A_{<i})
    bwd_c: np.ndarray  # (L,) constant of the backward constraint of layer i (plus A_{<=i})
    fixed_c: np.ndarray  # (L+1,) largest constant of fixed-segment constraints over A_{<p}; -inf-like if none
    fixed_t: int  # nanoseconds of every fixed segment together
    base: int


_NEG = np.iinfo(np.int64).min // 4


class Planner:
    """Predicts and optimises policies for the model a `Profile` describes."""

    def __init__(self, profile: Profile, free_grads_at_batch_start: bool | None = None) -> None:
        """``free_grads_at_batch_start``: predict a job that frees the previous step's gradients at batch
        start (they are not alive in the forward; `RecomputeCallback`'s default where safe) or not
        (Lightning's order); ``None``: as the profile says (`Profile.free_grads_at_batch_start`)."""
        if not isinstance(profile, Profile):
            raise PlannerError(f"profile: expected a tuner.profile.Profile, got {type(profile).__name__}")
        self.profile = profile
        self.names = profile.layer_names
        self._check_timeline()
        frees = profile.free_grads_at_batch_start if free_grads_at_batch_start is None else free_grads_at_batch_start
        if frees and profile.forward_grad_bytes is None:
            raise PlannerError(
                f"free_grads_at_batch_start: the profile has no {ZERO_GRAD_SEGMENT!r} segment (it predates it), so "
                f"the gradients alive in the forward are unknown; profile again"
            )
        self.free_grads_at_batch_start = bool(frees)
        # Freed at batch start, the previous step's gradients leave the base level, and Lightning's zero_grad
        # (the segment that freed them) frees nothing: every level before it drops by these bytes, none after.
        self._freed_grads = (profile.forward_grad_bytes or 0) if frees else 0

    # ------------------------------------------------------------------ inputs

    def _check_timeline(self) -> None:
        n = len(self.profile.layers)
        p = 0
        for key in self.profile.timeline:
            kind, _, rest = key.partition(":")
            if kind == "fixed":
                if rest not in self.profile.fixed:
                    raise PlannerError(f"profile: timeline names fixed segment {rest!r}, which the profile lacks")
                continue
            if kind not in ("fwd", "bwd") or not rest.isdigit() or int(rest) >= n:
                raise PlannerError(f"profile: malformed timeline entry {key!r}")
            i = int(rest)
            # The solver's prefix-sum form needs forward in order and backward in reverse.
            if (kind == "fwd" and p != i) or (kind == "bwd" and p != i + 1):
                raise PlannerError(
                    f"profile: timeline entry {key!r} out of order; the planner needs the layers' forwards in order "
                    f"and their backwards in reverse order"
                )
            p = i + 1 if kind == "fwd" else i

    def _modes(self, modes: Sequence[str] | None) -> list[str]:
        if modes is None:
            return [m for m in ALL_MODES if m in self.profile.modes]
        out = []
        for m in modes:
            name = m.value if isinstance(m, Mode) else str(m).strip().lower()
            if name not in self.profile.modes:
                raise PlannerError(f"modes: {m!r} is not in the profile; valid: {', '.join(self.profile.modes)}")
            out.append(name)
        if not out:
            raise PlannerError(f"modes: empty; valid: {', '.join(self.profile.modes)}")
        return [m for m in ALL_MODES if m in out]  # canonical order: it breaks ties

    def _scale(self, micro_batch: int | None) -> tuple[int, float]:
        mb = self.profile.micro_batch if micro_batch is None else micro_batch
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
            raise PlannerError(f"micro_batch: must be a positive integer, got {micro_batch!r}")
        return mb, mb / self.profile.micro_batch

    @staticmethod
    def _seg(c: SegmentCost, k: float) -> tuple[int, int, float]:
        """(delta, peak, seconds) scaled by ``k`` (see the module docstring)."""
        if k == 1.0 or not c.scales:
            return c.delta, c.peak, c.seconds
        g, sd, sp = c.grad, c.static_delta, c.static_peak  # the static parts: see `tuner.planner.sharding`
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

    def _tables(self, modes: list[str], k: float) -> _Tables:
        prof = self.profile
        n, nm = len(prof.layers), len(modes)
        a = np.zeros((n, nm), np.int64)
        f = np.zeros((n, nm), np.int64)
        b = np.zeros((n, nm), np.int64)
        t = np.zeros((n, nm), np.int64)
        for i, layer in enumerate(prof.layers):
            for j, m in enumerate(modes):
                fd, fp, fs = self._seg(layer.fwd[m], k)
                _, bp, bs = self._seg(layer.bwd[m], k)
                a[i, j], f[i, j], b[i, j], t[i, j] = fd, fp, bp, round((fs + bs) * 1e9)
        net = np.array([self._net(i, k) for i in range(n)], np.int64)
        base = prof.base_bytes - self._freed_grads + round(prof.batch_bytes * (k - 1))
        fwd_c = np.zeros(n, np.int64)
        bwd_c = np.zeros(n, np.int64)
        fixed_c = np.full(n + 1, _NEG, np.int64)
        fixed_c[0] = base  # the level before the step is a candidate for the peak too
        const, fixed_t, p = base, 0, 0  # the level is const + A_{<p}
        for key in prof.timeline:
            kind, _, rest = key.partition(":")
            if kind == "fixed":
                d, pk, s = self._fixed_seg(rest, k)
                fixed_c[p] = max(fixed_c[p], const + pk)
                const += d
                fixed_t += round(s * 1e9)
            elif kind == "fwd":
                i = int(rest)
                fwd_c[i] = const
                p = i + 1
            else:
                # Layer i's backward starts at const + A_{<=i}; it leaves net_i in place of a_i.
                i = int(rest)
                bwd_c[i] = const
                const += int(net[i])
                p = i
        return _Tables(modes, a, f, b, t, net, fwd_c, bwd_c, fixed_c, fixed_t, base)

    def _build(self, modes: Sequence[str] | None, micro_batch: int | None) -> tuple[_Tables, int]:
        mlist = self._modes(modes)
        mb, k = self._scale(micro_batch)
        return self._tables(mlist, k), mb

    # ------------------------------------------------------------------ prediction

    def predict(self, policy: PolicyLike | Mapping[str, str], micro_batch: int | None = None) -> Prediction:
        """Predicted peak memory and step time of ``policy`` at ``micro_batch`` (default: the profiled one).

        ``policy`` is a `RecomputePolicy`, a policy-file mapping, a path, or a plain
        ``{layer path: mode}`` mapping. A mode the profile did not measure is a `PlannerError`.
        """
        modes = self._resolve(policy)
        mb, _ = self._scale(micro_batch)
        return self._predict(modes, mb)

    def _predict(self, modes: list[str], mb: int) -> Prediction:
        """`predict` for resolved per-layer modes: the timeline walk of the module docstring."""
        k = mb / self.profile.micro_batch
        prof = self.profile
        level = base = prof.base_bytes - self._freed_grads + round(prof.batch_bytes * (k - 1))
        peak, peak_at, total = level, "start", 0.0
        bwd_peak: dict[int, int] = {}
        for key in prof.timeline:
            kind, _, rest = key.partition(":")
            if kind == "fixed":
                d, pk, s = self._fixed_seg(rest, k)
                cand, level = level + pk, level + d
            else:
                i = int(rest)
                layer, m = prof.layers[i], modes[i]
                if kind == "fwd":
                    d, pk, s = self._seg(layer.fwd[m], k)
                    cand, level = level + pk, level + d
                else:
                    d_fwd = self._seg(layer.fwd[m], k)[0]
                    _, pk, s = self._seg(layer.bwd[m], k)
                    cand, level = level + pk, level + self._net(i, k) - d_fwd
                    bwd_peak[i] = cand
            total += round(s * 1e9)
            if cand > peak:
                peak, peak_at = cand, key
        layers = []
        for i, layer in enumerate(prof.layers):
            m = modes[i]
            fd, _, fs = self._seg(layer.fwd[m], k)
            _, _, bs = self._seg(layer.bwd[m], k)
            layers.append(
                LayerPrediction(layer.name, m, fd, fs, bs, round(layer.recompute_flops(m) * k), bwd_peak.get(i, 0))
            )
        return Prediction(int(peak), total / 1e9, mb, peak_at, base, tuple(layers), prof.estimated)

    def _resolve(self, policy: PolicyLike | Mapping[str, str]) -> list[str]:
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
        return modes

    # ------------------------------------------------------------------ solving

    def solve(
        self, budget_bytes: int | str, modes: Sequence[str] | None = None, micro_batch: int | None = None
    ) -> PlannedPolicy:
        """The policy with the least predicted step time whose predicted peak is at most ``budget_bytes``.

        Raises:
            BudgetError: even the least-memory policy exceeds the budget (the message states that minimum).
        """
        budget = _budget_bytes(budget_bytes)
        tab, mb = self._build(modes, micro_batch)
        picks = self._dp_time(tab, budget)
        if picks is None:
            least = self._min_peak(tab)
            raise BudgetError(
                f"budget {format_bytes(budget)} ({budget} bytes) is below the least achievable predicted peak "
                f"{format_bytes(least)} ({least} bytes) with modes {', '.join(tab.modes)} at micro-batch {mb}",
                budget_bytes=budget,
                min_peak_bytes=least,
            )
        return self._plan([tab.modes[j] for j in picks], mb)

    def min_peak(self, modes: Sequence[str] | None = None, micro_batch: int | None = None) -> int:
        """The least predicted peak any policy over ``modes`` reaches."""
        tab, _ = self._build(modes, micro_batch)
        return self._min_peak(tab)

    def pareto_front(self, modes: Sequence[str] | None = None, micro_batch: int | None = None) -> list[PlannedPolicy]:
        """Every policy not beaten on both peak and step time, by increasing peak (decreasing time)."""
        tab, mb = self._build(modes, micro_batch)
        return [self._plan([tab.modes[j] for j in picks], mb) for picks in self._dp_front(tab)]

    def _plan(self, modes: list[str], mb: int) -> PlannedPolicy:
        mapping = dict(zip(self.names, modes, strict=False))
        policy = RecomputePolicy.from_modes(mapping)
        return PlannedPolicy(policy, mapping, self._predict(modes, mb))

    @staticmethod
    def _dp_time(tab: _Tables, budget: int) -> list[int] | None:
        """Least-time mode indices with every constraint <= budget, or None (see the module docstring)."""
        n, nm = tab.a.shape
        A = np.zeros(1, np.int64)
        T = np.zeros(1, np.int64)
        parents: list[tuple[np.ndarray, np.ndarray]] = []
        for i in range(n):
            keep = tab.fixed_c[i] + A <= budget
            idx = np.nonzero(keep)[0]
            A, T = A[idx], T[idx]
            if parents:  # fold the filter into the previous layer's back-pointers
                parents[-1] = (parents[-1][0][idx], parents[-1][1][idx])
            cand_a, cand_t, cand_p, cand_m = [], [], [], []
            for j in range(nm):
                a2 = A + tab.a[i, j]
                ok = (tab.fwd_c[i] + A + tab.f[i, j] <= budget) & (tab.bwd_c[i] + a2 + tab.b[i, j] <= budget)
                sel = np.nonzero(ok)[0]
                cand_a.append(a2[sel])
                cand_t.append(T[sel] + tab.t[i, j])
                cand_p.append(sel)
                cand_m.append(np.full(sel.size, j, np.int64))
            A, T = np.concatenate(cand_a), np.concatenate(cand_t)
            P, M = np.concatenate(cand_p), np.concatenate(cand_m)
            if A.size == 0:
                return None
            order = np.lexsort((T, A))  # by A, then T; stable, so generation order breaks exact ties
            A, T, P, M = A[order], T[order], P[order], M[order]
            best_before = np.minimum.accumulate(T)
            keep = np.ones(A.size, bool)
            keep[1:] = T[1:] < best_before[:-1]  # strictly faster than every state with no more memory
            A, T, P, M = A[keep], T[keep], P[keep], M[keep]
            parents.append((P, M))
        keep = tab.fixed_c[n] + A <= budget
        idx = np.nonzero(keep)[0]
        if idx.size == 0:
            return None
        # States are sorted by A with T strictly decreasing, so the last feasible one is the fastest.
        k = int(idx[-1])
        picks = []
        for P, M in reversed(parents):
            picks.append(int(M[k]))
            k = int(P[k])
        return picks[::-1]

    @staticmethod
    def _min_peak(tab: _Tables) -> int:
        """The least predicted peak: the same DP with the running maximum as the cost."""
        n, nm = tab.a.shape
        A = np.zeros(1, np.int64)
        C = np.array([tab.fixed_c[0]], np.int64)
        for i in range(n):
            C = np.maximum(C, tab.fixed_c[i] + A)
            cand_a, cand_c = [], []
            for j in range(nm):
                a2 = A + tab.a[i, j]
                cand_a.append(a2)
                cand_c.append(
                    np.maximum(C, np.maximum(tab.fwd_c[i] + A + tab.f[i, j], tab.bwd_c[i] + a2 + tab.b[i, j]))
                )
            A, C = np.concatenate(cand_a), np.concatenate(cand_c)
            order = np.lexsort((C, A))
            A, C = A[order], C[order]
            keep = np.ones(A.size, bool)
            keep[1:] = C[1:] < np.minimum.accumulate(C)[:-1]
            A, C = A[keep], C[keep]
        return int(np.min(np.maximum(C, tab.fixed_c[n] + A)))

    @staticmethod
    def _dp_front(tab: _Tables) -> list[list[int]]:
        """Mode indices of every Pareto-optimal (peak, time) policy, by increasing peak."""
        n, nm = tab.a.shape
        a, f, b, t = tab.a.tolist(), tab.f.tolist(), tab.b.tolist(), tab.t.tolist()
        # A state: (A, P, T, parent index, mode); states of a layer sorted by A.
        states: list[tuple[int, int, int, int, int]] = [(0, int(tab.fixed_c[0]), 0, -1, -1)]
        history: list[list[tuple[int, int, int, int, int]]] = []
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
            states = _pareto3(cands)
        history.append(states)
        end = int(tab.fixed_c[n])
        finals = sorted(
            ((max(P, end + A), T, s) for s, (A, P, T, _, _) in enumerate(states)), key=lambda x: (x[0], x[1])
        )
        front, best_t = [], None
        for _, T, s in finals:
            if best_t is None or best_t > T:
                best_t = T
                front.append(s)
        out = []
        for s in front:
            picks = []
            k = s
            for layer in range(n, 0, -1):
                _, _, _, parent, mode = history[layer][k]
                picks.append(mode)
                k = parent
            out.append(picks[::-1])
        return out


def _pareto3(cands: list[tuple[int, int, int, int, int]]) -> list[tuple[int, int, int, int, int]]:
    """The (A, P, T)-non-dominated candidates, given sorted by A (then P, T).

    Sweeping by A, a candidate is dominated iff some earlier one has P' <= P and T' <= T: the
    staircase of earlier (P, T) points (P ascending, T strictly descending) answers that with a bisect.
    """
    keep: list[tuple[int, int, int, int, int]] = []
    stair_p: list[int] = []
    stair_t: list[int] = []
    for c in cands:
        _, P, T, _, _ = c
        pos = bisect.bisect_right(stair_p, P)
        if pos > 0 and stair_t[pos - 1] <= T:
            continue
        keep.append(c)
        end = pos
        while end < len(stair_p) and stair_t[end] >= T:
            end += 1
        stair_p[pos:end] = [P]
        stair_t[pos:end] = [T]
    return keep
