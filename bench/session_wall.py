"""A tuning session's wall time: the race on and off, trial workers forked or fresh, side by side.

Each configuration runs ``recompute-tune RECIPE --format json`` in a fresh folder (fresh study and
MLflow store); the configurations take turns within each round, in a rotated order, so each sees
the machine's slow and quick moments alike. Reported per configuration: the median wall and its
range; per round, each configuration's wall over the baseline's (the first configuration: the
tuner before the race, every worker a fresh interpreter), with the median and range of those
ratios. The target it checks (issue "decisions that survive a noisy machine"): a session with the
race at most 30% over the tuner before it.

    python bench/session_wall.py --rounds 3 --out bench/results/session_wall.json
    python bench/session_wall.py --workload wide4 --configs race-off/fresh,race-on/forked \
        --out bench/results/session_wall-wide4.json     # a workload of bench/decision_quality.py

Configurations: ``race-off/fresh`` (the baseline), ``race-on/fresh``, ``race-on/forked``,
``race-off/forked``. ``fresh`` sets ``RECOMPUTE_TUNE_FORK_SERVER=0``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CONFIGS = {
    "race-off/fresh": (False, False),
    "race-on/fresh": (True, False),
    "race-on/forked": (True, True),
    "race-off/forked": (False, True),
}


def session(recipe: dict[str, Any], *, race: bool, forked: bool) -> dict[str, Any]:
    """One session in a fresh folder: its wall time, exit status, trial count and promoted policy."""
    with tempfile.TemporaryDirectory(prefix="wall-") as tmp:
        folder = Path(tmp)
        path = folder / "recipe.yaml"
        path.write_text(yaml.safe_dump({**recipe, "race": {**recipe.get("race", {}), "enabled": race}}), "utf-8")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RECOMPUTE_TUNE_FORK_SERVER": "1" if forked else "0"}
        began = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "tuner", str(path), "--format", "json"],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
            check=False,
        )
        wall = time.perf_counter() - began
    row: dict[str, Any] = {"wall_s": round(wall, 1), "exit": proc.returncode}
    try:
        summary = json.loads(proc.stdout)
    except json.JSONDecodeError:
        row["error"] = proc.stderr[-800:]
        return row
    best = summary.get("best") or {}
    row.update(trials=len(summary.get("trials") or ()), promoted=best.get("policy_short"), status=summary.get("status"))
    race_part = summary.get("race") or {}
    if race_part:
        row.update(race_wall_s=race_part.get("wall_s"), race_rounds=race_part.get("select_rounds"))
    return row


def report(rows: list[dict[str, Any]], names: list[str]) -> str:
    """The table: median wall per configuration, and the per-round ratios over the baseline."""
    base = names[0]
    over = f"over {base} (median, range)"
    lines = [f"{'configuration':<18} {'n':>2} {'wall median':>12} {'range':>16} {over:>40}"]
    by_round: dict[int, dict[str, float]] = {}
    for r in rows:
        if r.get("exit") == 0:
            by_round.setdefault(r["round"], {})[r["config"]] = r["wall_s"]
    for name in names:
        walls = [r["wall_s"] for r in rows if r["config"] == name and r.get("exit") == 0]
        if not walls:
            lines.append(f"{name:<18}  0 (no session finished)")
            continue
        ratios = [w[name] / w[base] for w in by_round.values() if name in w and base in w]
        ratio = (
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f}, {len(ratios)} rounds)"
            if ratios and name != base
            else "-"
        )
        span = f"{min(walls):.0f}..{max(walls):.0f} s"
        lines.append(f"{name:<18} {len(walls):>2} {statistics.median(walls):>10.0f} s {span:>16} {ratio:>40}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "quickstart.yaml")
    parser.add_argument(
        "--workload",
        help="instead of --recipe: a workload of bench/decision_quality.py (gpt4, wide4), its recipe as that "
        "benchmark's sessions run it",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated; the first is the baseline")
    parser.add_argument("--out", type=Path, default=RESULTS / "session_wall.json")
    args = parser.parse_args()
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        parser.error(f"--configs: unknown {', '.join(unknown) or '(none given)'}; valid: {', '.join(CONFIGS)}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    if args.workload:
        sys.path.insert(0, str(ROOT / "bench"))
        from decision_quality import WORKLOADS, recipe_dict

        if args.workload not in WORKLOADS:
            parser.error(f"--workload {args.workload!r}; valid: {', '.join(WORKLOADS)}")
        # The benchmark's recipe, its stores and output in the session's own folder (relative paths).
        recipe = recipe_dict(args.workload, Path("."), race=False)
        recipe.update(tracking={"uri": "sqlite:///mlflow.db", "experiment": f"wall-{args.workload}"})
        recipe.update(study={"storage": "optuna.log"}, output="policy.yaml")
        source = f"decision_quality workload {args.workload}"
    else:
        recipe = yaml.safe_load(args.recipe.read_text(encoding="utf-8"))
        source = str(args.recipe)
    rows: list[dict[str, Any]] = []
    for i in range(args.rounds):
        order = names[i % len(names) :] + names[: i % len(names)]  # rotated: no configuration always goes first
        for name in order:
            race, forked = CONFIGS[name]
            row = {"round": i, "config": name, **session(recipe, race=race, forked=forked)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    table = report(rows, names)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"recipe": source, "rows": rows}, indent=1) + "\n", encoding="utf-8")
    args.out.with_suffix(".txt").write_text(table + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
