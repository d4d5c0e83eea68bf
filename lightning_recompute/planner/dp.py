"""The exact solvers over a step's tables (the model: `lightning_recompute.planner`)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


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
    """The DP over layers: states ``(A, cost)`` within ``budget``, pruned to the non-dominated, with back-pointers.

    The cost is the time so far, or with ``by_peak`` the running maximum of the candidates (the peak so far).
    """
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
