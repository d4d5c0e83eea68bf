"""Two runs of ``bench/compare.py`` side by side: the tuned policy against full recompute and the best fitting peer.

Run:  python bench/compare_runs.py bench/results/compare-previous.json bench/results/compare.json

Prints a markdown table per budget: for each workload in either run, the tuned policy's choice and
tokens/s, its speed-up over full recompute, and its ratio to the fastest peer that fits (``>= 1``:
tuned wins or ties), previous run beside this one; then the issue-13 targets as counts.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TIE = 0.02
"""A peer within 2 % of the tuned policy counts as a tie (bench/compare.py's --tolerance)."""


def _rows(result: dict[str, Any]) -> dict[tuple[str, str], dict[str, dict[str, Any]]]:
    """``{(workload, budget): {method: row}}``."""
    out: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for w in result["workloads"]:
        for r in w["rows"]:
            out.setdefault((w["workload"]["name"], f"{r['budget']:g}"), {})[r["method"]] = r
    return out


def _figures(rows: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    if rows is None:
        return {}
    tuned, full = rows.get("tuned", {}), rows.get("full", {})
    t = tuned.get("tokens_per_s")
    peers = [
        (r["tokens_per_s"], m)
        for m, r in rows.items()
        if m != "tuned" and r.get("fits") and r.get("tokens_per_s") and m != "planner"
    ]
    best = max(peers, default=None)
    return {
        "choice": tuned.get("detail") if t else "nothing promoted",
        "tokens": t,
        "vs_full": t / full["tokens_per_s"] if t and full.get("fits") and full.get("tokens_per_s") else None,
        "vs_peer": t / best[0] if t and best else None,
        "peer": best[1] if best else None,
    }


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def report(old: dict[str, Any], new: dict[str, Any]) -> str:
    a, b = _rows(old), _rows(new)
    keys = list(dict.fromkeys([*a, *b]))
    budgets = sorted({k[1] for k in keys}, key=float)
    lines: list[str] = []
    for budget in budgets:
        lines += [
            f"**Budget {float(budget):.0%}**",
            "",
            "| workload | tuned choice (prev → now) | tuned tokens/s (prev → now) | x full (prev → now) "
            "| x best fitting peer (prev → now) |",
            "|---|---|---:|---:|---:|",
        ]
        for key in (k for k in keys if k[1] == budget):
            p, n = _figures(a.get(key)), _figures(b.get(key))
            lines.append(
                f"| {key[0]} | {p.get('choice', 'not run')} → {n.get('choice', 'not run')} "
                f"| {_f(p.get('tokens'), '.0f')} → {_f(n.get('tokens'), '.0f')} "
                f"| {_f(p.get('vs_full'), '.3f')} → {_f(n.get('vs_full'), '.3f')} "
                f"| {_f(p.get('vs_peer'), '.3f')} ({p.get('peer') or '-'}) → "
                f"{_f(n.get('vs_peer'), '.3f')} ({n.get('peer') or '-'}) |"
            )
        lines.append("")
    half = [k for k in b if k[1] == "0.5"]
    fast = [k for k in half if (_figures(b[k]).get("vs_full") or 0) >= 1.15]
    beaten = [
        f"{k[0]}@{float(k[1]):.0%}"
        for k in b
        if _figures(b[k]).get("vs_peer") is not None and _figures(b[k])["vs_peer"] < 1 - TIE
    ]
    lines.append(
        f"Targets (this run): tuned >= 1.15x full at 50% on {len(fast)} of {len(half)} workloads "
        f"({', '.join(k[0] for k in fast) or 'none'}); slower than a fitting peer (beyond {TIE:.0%}) at: "
        f"{', '.join(beaten) or 'nowhere'}."
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("previous", type=Path)
    parser.add_argument("current", type=Path)
    args = parser.parse_args(argv)
    print(report(json.loads(args.previous.read_text()), json.loads(args.current.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
