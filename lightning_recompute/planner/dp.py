"""The exact solvers over a step's tables (the model: `lightning_recompute.planner`): dynamic programmes over
layers whose state is the bytes kept so far, pruned to the non-dominated states.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

__all__ = ["Tables", "fastest_within", "least_peak", "pareto_picks"]


@dataclass
class Tables:
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


def fastest_within(tab: Tables, budget: int) -> list[int] | None:
    """Least-time mode indices with every constraint <= budget, or None."""
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


def least_peak(tab: Tables) -> int:
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
            cand_c.append(np.maximum(C, np.maximum(tab.fwd_c[i] + A + tab.f[i, j], tab.bwd_c[i] + a2 + tab.b[i, j])))
        A, C = np.concatenate(cand_a), np.concatenate(cand_c)
        order = np.lexsort((C, A))
        A, C = A[order], C[order]
        keep = np.ones(A.size, bool)
        keep[1:] = C[1:] < np.minimum.accumulate(C)[:-1]
        A, C = A[keep], C[keep]
    return int(np.min(np.maximum(C, tab.fixed_c[n] + A)))


def pareto_picks(tab: Tables) -> list[list[int]]:
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
    finals = sorted(((max(P, end + A), T, s) for s, (A, P, T, _, _) in enumerate(states)), key=lambda x: (x[0], x[1]))
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
    """The (A, P, T)-non-dominated candidates, given sorted by A (then P, T), found with a bisect on
    the staircase of earlier (P, T) points.
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
