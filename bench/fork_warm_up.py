"""Does a forked trial worker step as fast as a fresh interpreter? Fresh, forked, forked from a warmed server.

A trial's figures must be what the training job will see. The fork server (`tuner._trials.forkserver`)
saves each worker the imports, but a child inherits its server's memory as it was at the fork. This
benchmark times the steps of a small, dispatch-bound model (four ``Linear(32, 32)``, batch 8, one
thread: where the per-operator cost shows most) in three kinds of process:

- ``fresh``: a new interpreter that imports what the server imports (`forkserver.PRELOAD`);
- ``cold``: children of a server that imported `PRELOAD` and nothing else (the fork server as it is);
- ``warm``: children of a server that also ran a few training steps of another tiny model before
  forking (`_warm_up`): whether torch's lazily built state, made once in the server rather than in
  every child, changes a child's speed. It did not (`docs/BENCHMARKS.md`), so the server does not.

Each round runs ``--per`` processes of each kind (a server forks its ``--per`` children one after
the other, as it forks trials), kinds in a rotated order so each sees the machine's slow and quick
moments alike. Each process times ``--steps`` steps after 100 warm-up steps and reports their
median. Reported: per kind, the median of its processes' medians and their range; per round, each
kind's median over fresh's, with the median and range of those ratios.

    python bench/fork_warm_up.py --rounds 6 --per 3 --out bench/results/fork_warm_up.json

Pin it to one core (``taskset -c 0``) on a quiet machine: it measures microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
KINDS = ("fresh", "cold", "warm")


def _steps(n: int) -> dict[str, Any]:
    """Median microseconds a step over ``n`` steps, after 100 unmeasured; the process's thread count."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    x = torch.randn(8, 32)

    def one() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    for _ in range(100):
        one()
    times = []
    for _ in range(n):
        began = time.perf_counter_ns()
        one()
        times.append(time.perf_counter_ns() - began)
    return {"us": statistics.median(times) / 1000, "threads": len(os.listdir("/proc/self/task"))}


def _warm_up() -> None:
    """Three AdamW steps of a 16-wide MLP: torch's first-use state built before the fork.

    A few hundred elements a tensor: no operator reaches a parallel region, whose OpenMP pool would
    not survive the fork (`_process` checks the server still has one thread).
    """
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(3):
        model(torch.randn(4, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _process(kind: str, per: int, steps: int) -> None:
    """In a child interpreter: print one JSON line per measured process of ``kind``."""
    from tuner._trials import forkserver

    for name in forkserver.PRELOAD:
        __import__(name)
    if kind == "fresh":
        print(json.dumps(_steps(steps)), flush=True)
        return
    if kind == "warm":
        _warm_up()
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise SystemExit(f"the server has {threads} threads before forking; a fork would not carry them")
    for _ in range(per):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            os.setsid()
            os.write(write, json.dumps(_steps(steps)).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as fh:
            print(fh.read().decode(), flush=True)
        os.waitpid(pid, 0)


def _run(kind: str, per: int, steps: int) -> list[float]:
    """Medians (us a step) of ``per`` processes of ``kind``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, "--child", kind, "--per", str(per), "--steps", str(steps)]
    out: list[float] = []
    for _ in range(per if kind == "fresh" else 1):
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=True)
        out += [json.loads(line)["us"] for line in proc.stdout.splitlines() if line.strip()]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per", type=int, default=3, help="processes of each kind a round")
    parser.add_argument("--steps", type=int, default=600, help="timed steps a process")
    parser.add_argument("--out", type=Path, default=RESULTS / "fork_warm_up.json")
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _process(args.child, args.per, args.steps)
        return 0

    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]
        got = {kind: _run(kind, args.per, args.steps) for kind in order}
        row = {"round": r + 1, "order": list(order), **{k: [round(v, 1) for v in got[k]] for k in KINDS}}
        rows.append(row)
        print(json.dumps(row), flush=True)

    lines = [
        f"fork_warm_up: {args.rounds} rounds x {args.per} processes a kind, {args.steps} timed steps each; "
        "us a step of 4x Linear(32,32), batch 8, one thread",
        f"{'kind':<6} {'processes':>9} {'median us':>10} {'range':>15} {'x fresh (rounds)':>26}",
    ]
    summary: dict[str, Any] = {}
    slow_line = 1.25 * statistics.median([v for row in rows for v in row["fresh"]])
    for kind in KINDS:
        values = [v for row in rows for v in row[kind]]
        ratios = [statistics.median(row[kind]) / statistics.median(row["fresh"]) for row in rows]
        summary[kind] = {
            "processes": len(values),
            "median_us": round(statistics.median(values), 1),
            "min_us": round(min(values), 1),
            "max_us": round(max(values), 1),
            "ratio_median": round(statistics.median(ratios), 3),
            "ratio_min": round(min(ratios), 3),
            "ratio_max": round(max(ratios), 3),
            "slow_processes": sum(v > slow_line for v in values),
        }
        s = summary[kind]
        lines.append(
            f"{kind:<6} {s['processes']:>9} {s['median_us']:>10} {s['min_us']:>7}..{s['max_us']:<7} "
            f"{s['ratio_median']:>10} ({s['ratio_min']}..{s['ratio_max']})"
        )
    lines.append(
        "slow processes (over 1.25x fresh's median): " + ", ".join(f"{k} {summary[k]['slow_processes']}" for k in KINDS)
    )
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": rows, "summary": summary}, indent=2) + "\n", "utf-8")
    args.out.with_suffix(".txt").write_text(text + "\n", "utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
