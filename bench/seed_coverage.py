"""Does the planner seed the fastest policy? Its seeds from many timed profiles, quiet and beside a neighbour.

A tuning session profiles its model once (a few timed steps per mode) and seeds the study with the
planner's picks; a policy no seed or sampled trial measures cannot be promoted, however good the race.
On `bench/decision_quality.py`'s ``gpt4`` the profile sometimes ranked ``selective`` ahead of ``full``, the
planner's pick was ``ss..``, and in 3 of 10 sessions no trial measured ``FF..``, the fastest policy. Since
then each kind of recomputation's own pick is seeded too (`tuner._search.planner_seeds.kind_picks`).

This takes ``--profiles`` profiles per condition (quiet, and beside the seeded noisy neighbour that
``decision_quality.py`` uses; conditions take turns), builds the planner's seeds from each, and counts how
often the fastest policy by the stored ranking truth is among them: with the seeds as they are, and with
the pick and the front's points alone (the seeds before the kind picks), from the same profiles.

    python bench/seed_coverage.py --workloads gpt4,wide4 --profiles 10 --out bench/results/seed_coverage.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python bench/seed_coverage.py` imports this checkout's packages

from bench.decision_quality import RESULTS, recipe_dict  # noqa: E402 - after the path above


def short(modes: dict[str, str]) -> str:
    """``FF..``-style: one character per layer."""
    from lightning_recompute.policy import glyph

    return "".join(glyph(m) for m in modes.values())


def seeds_before_kind_picks(planner: Any, budget: int, modes: Sequence[str]) -> list[str]:
    """The planner's seeds as they were before the kind picks: its pick at the budget and the front's
    points other than the pick (`tuner._search.planner_seeds.front_points`)."""
    from tuner._search.planner_seeds import front_points

    pick = planner.solve(budget, modes=list(modes))
    return [pick.short()] + [p.short() for p in front_points(planner, budget, modes, None, [dict(pick.modes)])]


def coverage(rows: Sequence[dict[str, Any]], best: str) -> dict[str, Any]:
    """How many of ``rows`` (one per profile) seed ``best``, now and before the kind picks; the picks seen."""
    return {
        "profiles": len(rows),
        "best_seeded": sum(best in r["seeds"].values() for r in rows),
        "best_seeded_before": sum(best in r["before"] for r in rows),
        "picks": dict(Counter(r["seeds"].get("planner:budget", "-") for r in rows)),
        "seeded_by": dict(Counter(next((k for k, v in r["seeds"].items() if v == best), "-") for r in rows)),
    }


def one_profile(workload: str, noisy_seed: int | None) -> dict[str, Any]:
    """One timed profile of ``workload`` (as a session takes it), and the planner's seeds from it."""
    from bench.neighbour import noisy_neighbour
    from lightning_recompute.planner import Planner
    from tuner._search import SearchSpace, inspect_layers
    from tuner._search.planner_seeds import PROFILE_REPEATS, kind_picks, planner_seeds
    from tuner._trials import profile_recipe
    from tuner.recipe import from_dict

    with tempfile.TemporaryDirectory(prefix="seeds-") as tmp:
        recipe = from_dict(recipe_dict(workload, Path(tmp), race=True), source=Path(tmp) / "recipe.yaml")
    space = SearchSpace.for_layers(inspect_layers(recipe), recipe.search.modes)
    budget = recipe.budget.limit_bytes(None)
    if noisy_seed is None:
        profile = profile_recipe(recipe, None, repeats=PROFILE_REPEATS)
    else:
        with noisy_neighbour(noisy_seed, busy_s=3.0, idle_s=3.0):
            profile = profile_recipe(recipe, None, repeats=PROFILE_REPEATS)
    planner = Planner(profile)
    seeds, _ = planner_seeds(planner, space, budget, recipe.search.modes)
    pick = planner.solve(budget, modes=list(recipe.search.modes))
    return {
        "seeds": {s.name: short(dict(s.modes)) for s in seeds},
        # Each kind's own pick and its predicted step time over the pick's: how far off a profile can rank kinds.
        "kinds": {
            k: [p.short(), p.step_time_s / pick.step_time_s]
            for k, p in kind_picks(planner, budget, recipe.search.modes, None)
        },
        "before": seeds_before_kind_picks(planner, budget, recipe.search.modes),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="seed_coverage.py", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workloads", default="gpt4,wide4")
    parser.add_argument("--profiles", type=int, default=10, help="profiles per condition")
    parser.add_argument("--truth-from", type=Path, default=None, help="results holding each workload's ranking truth")
    parser.add_argument("--out", type=Path, default=RESULTS / "seed_coverage.json")
    args = parser.parse_args(argv)
    truths = {"gpt4": RESULTS / "decision_quality.json", "wide4": RESULTS / "decision_quality-wide4.json"}
    began = time.perf_counter()
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "workloads": {}}
    lines = ["planner seeds: is the fastest policy (by the ranking truth) among them?"]
    for workload in args.workloads.split(","):
        source = args.truth_from or truths[workload]
        best = json.loads(source.read_text(encoding="utf-8"))["workloads"][workload]["truth"]["best"]
        rows: dict[str, list[dict[str, Any]]] = {"quiet": [], "noisy": []}
        for i in range(args.profiles):
            for condition in ("quiet", "noisy") if i % 2 == 0 else ("noisy", "quiet"):  # taking turns
                row = one_profile(workload, None if condition == "quiet" else 1000 + i)
                rows[condition].append(row)
                print(f"[{time.perf_counter() - began:5.0f} s] {workload} {condition} #{i}: {row['seeds']}", flush=True)
        w = results["workloads"][workload] = {"best": best, "rows": rows}
        for condition, got in rows.items():
            c = w[f"coverage_{condition}"] = coverage(got, best)
            lines.append(
                f"{workload} {condition}: best {best} seeded in {c['best_seeded']}/{c['profiles']} profiles "
                f"(pick and front alone: {c['best_seeded_before']}/{c['profiles']}); planner:budget was "
                f"{', '.join(f'{k} x{v}' for k, v in sorted(c['picks'].items(), key=lambda kv: -kv[1]))}; "
                f"{best} seeded as {', '.join(f'{k} x{v}' for k, v in c['seeded_by'].items())}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1), encoding="utf-8")
    args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
