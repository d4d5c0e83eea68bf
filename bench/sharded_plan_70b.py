"""Time and memory of planning a 70B-class model per rank on the meta device.

Runs, in a fresh process (so its peak RSS is the command's own):

    recompute-tune plan recipes/llama-70b-fsdp-plan.yaml --meta H100 --world-size 64 --strategy fsdp

and prints its wall time, CPU time (user + system; on a shared machine the wall time mostly says
how busy the neighbours were) and maximum resident set size, with the machine's load average.
Targets: under 30 s and under 2 GiB. Run:

    python bench/sharded_plan_70b.py [--world-size 64] [--hardware H100]

The figures are printed and written to bench/results/sharded_plan_70b.txt.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 1800


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--hardware", default="H100")
    args = ap.parse_args()
    cmd = [
        sys.executable,
        "-m",
        "tuner",
        "plan",
        str(ROOT / "recipes" / "llama-70b-fsdp-plan.yaml"),
        "--meta",
        args.hardware,
        "--world-size",
        str(args.world_size),
        "--strategy",
        "fsdp",
    ]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE_S, check=False, cwd=ROOT)
    wall = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 1):  # 1: nothing fits the budget, still a plan
        print(proc.stderr[-4000:], file=sys.stderr)
        return proc.returncode
    front = next((line for line in proc.stdout.splitlines() if line.startswith("predicted Pareto front")), "?")
    cpu = usage.ru_utime + usage.ru_stime
    rss_mib = usage.ru_maxrss / 1024  # Linux reports KiB
    lines = [
        f"plan 70B-class (recipes/llama-70b-fsdp-plan.yaml) --meta {args.hardware} "
        f"--world-size {args.world_size} --strategy fsdp",
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {load:.1f} at start "
        f"/ {os.getloadavg()[0]:.1f} at end",
        f"wall {wall:.1f} s, CPU {cpu:.1f} s (user {usage.ru_utime:.1f} + system {usage.ru_stime:.1f}), "
        f"max RSS {rss_mib:.0f} MiB  (targets: 30 s, 2048 MiB)",
        front,
    ]
    text = "\n".join(lines)
    print(text)
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    (results / "sharded_plan_70b.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
