"""Tune-then-train against tuning inside the job: which reaches training step N sooner, and how good is
each choice?

For each workload (a recipe of this repository), interleaved ``--repeats`` times (the order of the
two arms alternates, so both see the same machine moments):

- **(a) tune, then train**: ``recompute-tune RECIPE`` in a fresh folder (fresh study and MLflow
  store), then a training job of ``--steps`` steps with ``RecomputeCallback(policy.yaml)``;
  its wall time is the two processes' together.
- **(b) AutoRecompute**: one training job of ``--steps`` steps with
  ``AutoRecompute(budget, margin, modes)`` from the recipe: tuning on its first steps, every one a
  training step.

Then **truth**: every policy either arm chose, every candidate the job raced and ``full`` race in one
process, interleaved, for ``--truth-rounds`` rounds without early stopping (`tuner._trials.run_race`);
each policy's true time is the median of its time over ``full``'s in the same round. The regret of a
choice is its true time over the best raced policy's (the best of the policies raced for truth, not
of the whole search space: the quickstart's space has hundreds of policies; the decision-quality
benchmark covers a whole space).

Training jobs run with ``OMP_NUM_THREADS=1``, as the recipes' trials do.

    python bench/auto_vs_tune.py                                   # both workloads, 3 repeats
    python bench/auto_vs_tune.py --workloads quickstart --repeats 1 --steps 100   # a quick look
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
WORKLOADS = {
    "quickstart": ROOT / "recipes" / "quickstart.yaml",
    "hf-llama-tiny": ROOT / "recipes" / "hf-llama-tiny.yaml",
}
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
CHILD_TIMEOUT_S = 3600


# ---------------------------------------------------------------------------------------------- children


def _child(kind: str, recipe_path: Path, steps: int, policy_path: Path | None) -> dict[str, Any]:
    """A training job of ``steps`` steps (in this process): ``train`` with a policy file, or ``auto``."""
    import lightning as L
    import torch

    from lightning_recompute import QUIET_TRAINER, RecomputeCallback
    from lightning_recompute.auto import AutoRecompute
    from tuner.recipe import build_datamodule, build_model, load

    torch.set_num_threads(1)
    recipe = load(recipe_path)
    L.seed_everything(0, verbose=False)
    model = build_model(recipe)
    callback: RecomputeCallback
    if kind == "train":
        assert policy_path is not None
        callback = RecomputeCallback(str(policy_path), measure_memory=False)
    else:
        callback = AutoRecompute(int(recipe.budget.value), margin=recipe.budget.margin, modes=recipe.search.modes)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        max_epochs=-1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[callback],
        **QUIET_TRAINER,
    )
    trainer.fit(model, datamodule=build_datamodule(recipe))
    out: dict[str, Any] = {"steps": trainer.global_step}
    if isinstance(callback, AutoRecompute):
        assert callback.decision is not None
        out.update(
            chosen=callback.decision.policy.to_dict(),
            short=callback.decision.short,
            tuning_steps=callback.tuning_steps,
            candidates=[c.policy.to_dict() for c in callback.candidates],
            summary=callback.decision.summary,
        )
    return out


def _run(cmd: list[str], cwd: Path) -> tuple[float, subprocess.CompletedProcess[str]]:
    began = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return wall, proc


def _last_json(stdout: str) -> dict[str, Any]:
    return json.loads(stdout.strip().splitlines()[-1])


def tune_then_train(recipe_path: Path, steps: int) -> dict[str, Any]:
    """Arm (a): ``recompute-tune`` in a fresh folder, then the training job with its policy file."""
    with tempfile.TemporaryDirectory(prefix="avt-") as tmp:
        folder = Path(tmp)
        data = yaml.safe_load(recipe_path.read_text(encoding="utf-8"))
        data.update(
            tracking={"uri": f"sqlite:///{folder / 'mlflow.db'}", "experiment": data["name"]},
            study={"storage": str(folder / "optuna.log")},
            output=str(folder / "policy.yaml"),
        )
        recipe = folder / "recipe.yaml"
        recipe.write_text(yaml.safe_dump(data), encoding="utf-8")
        tune_s, proc = _run([sys.executable, "-m", "tuner", str(recipe), "--format", "json"], folder)
        summary = json.loads(proc.stdout)
        train_s, proc = _run(
            [sys.executable, __file__, "--child", "train", "--recipe", str(recipe), "--steps", str(steps),
             "--policy", str(folder / "policy.yaml")],
            folder,
        )  # fmt: skip
        policy = yaml.safe_load((folder / "policy.yaml").read_text(encoding="utf-8"))
        return {
            "wall_s": tune_s + train_s,
            "tune_s": tune_s,
            "train_s": train_s,
            "chosen": policy,
            "short": (summary.get("best") or {}).get("policy_short"),
            "status": summary.get("status"),
        }


def auto(recipe_path: Path, steps: int) -> dict[str, Any]:
    """Arm (b): one training job with `AutoRecompute`."""
    with tempfile.TemporaryDirectory(prefix="avt-") as tmp:
        wall, proc = _run(
            [sys.executable, __file__, "--child", "auto", "--recipe", str(recipe_path), "--steps", str(steps)],
            Path(tmp),
        )
        return {"wall_s": wall, **_last_json(proc.stdout)}


# ---------------------------------------------------------------------------------------------- truth


def truth(recipe_path: Path, policies: list[dict[str, Any]], rounds: int) -> dict[str, float]:
    """True time over full's (median over interleaved rounds) of each policy, keyed by its glyphs."""
    from lightning_recompute import RecomputePolicy
    from lightning_recompute.race import RacePlan
    from tuner._search import inspect_layers
    from tuner._trials import run_race
    from tuner.recipe import load

    recipe = load(recipe_path)
    names = [layer.name for layer in inspect_layers(recipe)]
    full = RecomputePolicy.uniform("full")
    raced = {p.fingerprint(): p for p in (RecomputePolicy.from_dict(d).with_tuned_for(None) for d in policies)}
    raced.setdefault(full.fingerprint(), full)
    plan = RacePlan(steps=2, min_rounds=rounds, max_rounds=rounds, time_s=1e9, estimate_rounds=2)
    race = run_race(
        recipe,
        [(p, [p.short(names)]) for p in raced.values()],
        layer_names=names,
        references=[full],
        plan=plan,
        timeout_s=7200,
    )
    if not race.ok:
        raise SystemExit(f"truth race failed: {race.reason}")
    base = race.entrants[full.fingerprint()].select_s
    rel: dict[str, float] = {}
    for e in race.entrants.values():
        ratios = [t / f for t, f in zip(e.select_s, base, strict=True) if t and f]
        if e.out is None and ratios:
            rel[e.short] = statistics.median(ratios)
    return rel


def _short(policy: dict[str, Any], recipe_path: Path) -> str:
    from lightning_recompute import RecomputePolicy
    from tuner._search import inspect_layers
    from tuner.recipe import load

    return RecomputePolicy.from_dict(policy).short([layer.name for layer in inspect_layers(load(recipe_path))])


# ---------------------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--truth-rounds", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS / "auto_vs_tune.json")
    parser.add_argument("--child", choices=("train", "auto"), help=argparse.SUPPRESS)
    parser.add_argument("--recipe", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--policy", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.recipe, args.steps, args.policy)))
        return 0
    began = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - began:7.0f} s] {line}", file=sys.stderr, flush=True)

    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "workloads": {}}
    for name in args.workloads.split(","):
        path = WORKLOADS[name]
        runs: list[dict[str, Any]] = []
        for i in range(args.repeats):
            arms = [("tune", tune_then_train), ("auto", auto)]
            for arm, fn in arms if i % 2 == 0 else arms[::-1]:
                row = {"arm": arm, "repeat": i, **fn(path, args.steps)}
                row["short"] = _short(row["chosen"], path)
                runs.append(row)
                log(f"{name} #{i} {arm}: {row['wall_s']:.0f} s, chose {row['short']}")
        pool = [r["chosen"] for r in runs] + [c for r in runs if r["arm"] == "auto" for c in r["candidates"]]
        log(f"{name}: truth over {len({json.dumps(p, sort_keys=True) for p in pool})} policies ...")
        rel = truth(path, pool, args.truth_rounds)
        best = min(rel.values())
        for r in runs:
            r["regret"] = rel[r["short"]] / best if r["short"] in rel else None
        results["workloads"][name] = {"runs": runs, "truth_rel_time": rel, "steps": args.steps}
        RESULTS.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
    lines = report(results)
    print("\n".join(lines))
    args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


def report(results: dict[str, Any]) -> list[str]:
    lines = [
        f"wall time to reach step N: (a) recompute-tune then train, (b) AutoRecompute; regret = the choice's "
        f"true time over the best raced policy's ({results['args']['repeats']} interleaved repeats, medians)"
    ]
    lines.append(
        f"{'workload':<14} {'N':>4} {'(a) s':>7} {'tune s':>7} {'(b) s':>7} {'(b)/(a)':>8} {'range':>12} "
        f"{'regret a':>9} {'regret b':>9}"
    )
    for name, w in results["workloads"].items():
        a = [r for r in w["runs"] if r["arm"] == "tune"]
        b = [r for r in w["runs"] if r["arm"] == "auto"]
        ratios = [rb["wall_s"] / ra["wall_s"] for ra, rb in zip(sorted(a, key=_rep), sorted(b, key=_rep), strict=True)]
        ra = [r["regret"] for r in a if r["regret"] is not None]
        rb = [r["regret"] for r in b if r["regret"] is not None]
        lines.append(
            f"{name:<14} {w['steps']:>4} {statistics.median(r['wall_s'] for r in a):>7.0f} "
            f"{statistics.median(r['tune_s'] for r in a):>7.0f} {statistics.median(r['wall_s'] for r in b):>7.0f} "
            f"{statistics.median(ratios):>8.2f} {min(ratios):>5.2f}..{max(ratios):<5.2f} "
            f"{_med_max(ra):>9} {_med_max(rb):>9}"
        )
        for r in w["runs"]:
            lines.append(
                f"    #{r['repeat']} {r['arm']:<4} {r['wall_s']:>6.0f} s  chose {r['short']}  regret {r['regret']}"
            )
    return lines


def _rep(r: dict[str, Any]) -> int:
    return int(r["repeat"])


def _med_max(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}/{max(values):.3f}" if values else "-"


if __name__ == "__main__":
    sys.exit(main())
