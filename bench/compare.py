"""The tuned policy against every peer's way of choosing what to recompute, side by side, in one run.

For each workload (the reference GPT, eager and sdpa attention, two sizes, two sequence lengths,
and a stack whose width changes from layer to layer) and each budget (30 / 50 / 70 % of the
no-recompute peak), the methods are:

  none            no recomputation (where it fits)
  full            every layer recomputed (Lightning FSDP activation_checkpointing_policy, HF
                  gradient_checkpointing_enable)
  every-k         full on every k-th layer, the k with fewest recomputed layers that fits
                  (torchtitan / torchtune)
  selective-attn  selective on every layer saving only aten.mm/addmm: attention core recomputed
                  (Megatron-LM --recompute-granularity selective)
  op-sac          torchtitan op-level SAC: save matmuls except every other one, and attention kernels
  sqrt-n          one checkpoint per segment of sqrt(N) layers (Chen et al. 2016)
  compile         torch.compile(inductor) with activation_memory_budget = the budget's fraction
  torch-sac-ilp   torch.distributed._tools SAC estimator + MILP (probed; reported if it cannot run)
  planner         lightning_recompute.planner's exact solver on a measured profile, no trials
  tuned           the policy `recompute-tune` promotes (tuner.session.tune on a generated recipe)

The planner and the tuner choose per layer among none, selective, full and the save-list families
(selective:attn, selective:attn+wide, selective:attn+narrow; --no-families, and --smoke: the first three only),
and on the workloads named by --compile-search the tuner also searches compile: [false, true].

Peak memory: one Lightning run per configuration with `RecomputeCallback(measure_memory=True)`,
the exact CPU storage ledger with parameters, gradients, optimizer state and batch tracked, max
over a warm-up and a measured step: the figure the tuner's trials report. The peers (and the
no-recompute reference the budgets are fractions of) run in Lightning's order, the previous step's
gradients alive through the forward, as a job without the plugin runs; the planner's and the
tuner's policies free them at batch start, as `RecomputeCallback` does by default: that is one of
the plugin's levers, not a peer's. Throughput: separate,
unmetered steps of a plain training loop (forward, backward, AdamW step), interleaved: every
configuration of a workload once per round in a rotated order, for several rounds, medians.

Run:  python bench/compare.py            (full, ~45 min on 2 CPU cores, nothing else running)
      python bench/compare.py --quick    (one small workload)
Writes bench/results/compare[-quick].{txt,json} and docs/compare_<workload>.png.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import io
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml

from lightning_recompute import QUIET_TRAINER, RecomputeCallback, RecomputePolicy, apply_policy, layer_names
from lightning_recompute.modes import MODES as MODE_SPECS
from lightning_recompute.reference import ReferenceGPT, SyntheticTokens

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_methods as peers

ROOT = Path(__file__).resolve().parent.parent
BUDGETS = (0.3, 0.5, 0.7)
MODES = ("none", "selective", "full")
FAMILY_MODES = tuple(s.name for s in MODE_SPECS if s.is_family)
MEGATRON_SAVE = ("aten.mm", "aten.addmm")
METHODS = (
    "none",
    "full",
    "every-k",
    "selective-attn",
    "op-sac",
    "sqrt-n",
    "compile",
    "torch-sac-ilp",
    "planner",
    "tuned",
)
PEERS = METHODS[:-1]


@dataclass(frozen=True)
class Workload:
    name: str
    model: dict[str, Any]
    """ReferenceGPT init args (dropout 0: attention kernels can be cached by every method alike)."""
    batch: int

    @property
    def tokens(self) -> int:
        return self.batch * int(self.model["seq_len"])


def _gpt(n_layer: int, n_embd: int, seq_len: int, attention: str, **extra: Any) -> dict[str, Any]:
    return dict(
        vocab_size=256,
        seq_len=seq_len,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=4,
        dropout=0.0,
        attention=attention,
        **extra,
    )


FULL_WORKLOADS = (
    Workload("gpt-s-eager-128", _gpt(6, 64, 128, "eager"), 8),
    Workload("gpt-s-sdpa-256", _gpt(6, 64, 256, "sdpa"), 4),
    Workload("gpt-m-eager-128", _gpt(8, 128, 128, "eager"), 4),
    Workload("gpt-m-sdpa-128", _gpt(8, 128, 128, "sdpa"), 4),
    # Width grows then shrinks: the middle layers hold most of the activations, so a uniform
    # choice recomputes the cheap thin layers for nothing or keeps the fat ones it cannot afford.
    Workload("hetero-eager-128", _gpt(8, 64, 128, "eager", widths=[32, 64, 128, 192, 192, 128, 64, 32]), 4),
    # Long context: the (seq x seq) attention scores are most of what a layer keeps.
    Workload("gpt-s-eager-512", _gpt(4, 64, 512, "eager"), 2),
)
QUICK_WORKLOADS = (Workload("gpt-xs-eager-128", _gpt(4, 64, 128, "eager"), 4),)
SMOKE_WORKLOADS = (Workload("gpt-tiny-eager-64", _gpt(3, 32, 64, "eager"), 2),)


# --------------------------------------------------------------------------------------------- configurations


@dataclass
class Config:
    """One way of running a workload: how to prepare a fresh model, and what was measured."""

    key: str
    label: str
    prepare: Callable[[ReferenceGPT, Any], None]
    """``(model, meter_of)`` -> None; ``meter_of`` returns the active StorageMeter (memory pass) or None."""
    policy: RecomputePolicy | None = None
    """For the plugin's policies: applied by RecomputeCallback in the memory pass."""
    compile_metered: Callable[[ReferenceGPT, Any], None] | None = None
    """torch.compile only: a different preparation for the memory pass (see compare_methods)."""
    frees_grads: bool = False
    """Whether the memory pass frees the previous step's gradients at batch start (the plugin's
    `RecomputeCallback` default, one of its levers): on for the planner's and the tuner's policies,
    off for the peers, which run in Lightning's order as their own frameworks do."""
    peak_bytes: int | None = None
    step_times: list[float] = field(default_factory=list)
    error: str | None = None

    def step_time(self) -> float | None:
        return statistics.median(self.step_times) if self.step_times else None


def _policy_config(key: str, label: str, policy: RecomputePolicy, frees_grads: bool = False) -> Config:
    return Config(
        key=key,
        label=label,
        prepare=lambda m, _meter: apply_policy(m, policy),
        policy=policy,
        frees_grads=frees_grads,
    )


@dataclass
class Row:
    method: str
    budget: float
    config: str | None
    detail: str
    peak_bytes: int | None = None
    tokens_per_s: float | None = None
    fits: bool | None = None
    ratio: float | None = None
    """This row's throughput over the tuned policy's (None when either is missing)."""
    note: str = ""


# --------------------------------------------------------------------------------------------- measuring


def _model(wl: Workload) -> ReferenceGPT:
    torch.manual_seed(0)
    return ReferenceGPT(**wl.model)


def _data(wl: Workload, num_batches: int = 4) -> SyntheticTokens:
    return SyntheticTokens(
        vocab_size=wl.model["vocab_size"],
        seq_len=wl.model["seq_len"],
        batch_size=wl.batch,
        num_batches=num_batches,
        seed=0,
    )


def _batch(wl: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    dm = _data(wl)
    dm.setup("fit")
    return next(iter(dm.train_dataloader()))


def measure_peak(wl: Workload, cfg: Config) -> int:
    """Peak bytes of a warm-up and a measured Lightning step, metered by RecomputeCallback."""
    model = _model(wl)
    policy = cfg.policy if cfg.policy is not None else RecomputePolicy.uniform("none")
    callback = RecomputeCallback(policy, measure_memory=True, free_grads_at_batch_start=cfg.frees_grads)
    if cfg.policy is None:
        # The callback's meter exists only once fit starts; the compiled forward asks for it per call.
        prepare = cfg.compile_metered or cfg.prepare
        prepare(model, lambda: callback._meter)
        if cfg.compile_metered is not None:
            # Compile forward and backward before the meter runs: AOTAutograd traces with fake
            # tensors, which must not happen under the ledger's dispatch mode.
            model.loss(_batch(wl)).backward()
            model.zero_grad(set_to_none=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        max_epochs=-1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **QUIET_TRAINER,
        callbacks=[callback],
    )
    trainer.fit(model, datamodule=_data(wl))
    peaks = [r.peak_bytes for r in callback.records if r.peak_bytes is not None]
    if len(peaks) < 2:
        raise RuntimeError(f"{cfg.label}: {len(peaks)} metered steps, expected 2")
    return max(peaks)


class Runner:
    """A persistent model + optimizer per configuration, stepped in interleaved rounds."""

    def __init__(self, wl: Workload, cfg: Config) -> None:
        self.cfg = cfg
        self.model = _model(wl)
        cfg.prepare(self.model, lambda: None)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        self.batch = _batch(wl)

    def step(self) -> float:
        # What Lightning's automatic optimisation runs, without its per-step bookkeeping.
        t = time.perf_counter()
        loss = self.model.loss(self.batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t


def measure_times(wl: Workload, configs: Sequence[Config], rounds: int, steps: int, log: Callable[[str], None]) -> None:
    runners: list[Runner] = []
    for cfg in configs:
        try:
            t = time.perf_counter()
            runner = Runner(wl, cfg)
            runner.step()  # first call compiles (torch.compile) and creates the optimizer state
            runners.append(runner)
            if time.perf_counter() - t > 5:
                log(f"  {cfg.label}: first step took {time.perf_counter() - t:.0f} s (compilation)")
        except Exception as err:  # noqa: BLE001 - a configuration that cannot run is a row, not a crash
            cfg.error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            log(f"  {cfg.label}: cannot run: {cfg.error}")
    for r in range(rounds):
        order = runners[r % len(runners) :] + runners[: r % len(runners)] if runners else []
        for runner in order:
            runner.step()  # re-warms caches another configuration just evicted
            runner.cfg.step_times += [runner.step() for _ in range(steps)]


# --------------------------------------------------------------------------------------------- the tuner


@dataclass
class TunerRun:
    budget: float
    policy: RecomputePolicy | None
    status: str
    trials: int
    """Trials run in the session (`TrialRecord.ran`: what ``n_trials`` counts)."""
    trials_to_2pct: int | None
    seconds_to_2pct: float | None
    wall_s: float
    reasons: list[str]
    trial_table: list[dict[str, Any]]


def _recipe_dict(
    wl: Workload, budget_bytes: int, n_trials: int, name: str, modes: Sequence[str], compile_search: bool
) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"class_path": "lightning_recompute.reference.ReferenceGPT", "init_args": dict(wl.model)},
        "data": {
            "class_path": "lightning_recompute.reference.SyntheticTokens",
            "init_args": {
                "vocab_size": wl.model["vocab_size"],
                "seq_len": wl.model["seq_len"],
                "batch_size": wl.batch,
                "num_batches": 8,
            },
        },
        "trainer": {"accelerator": "cpu", "precision": "32-true"},
        "layers": "auto",
        # Margin 0: the tuner is held to exactly the budget every other method is judged by.
        "budget": {"value": int(budget_bytes), "margin": 0.0},
        "search": {
            "modes": list(modes),
            "n_trials": n_trials,
            "seed": 0,
            **({"compile": [False, True]} if compile_search else {}),
        },
        "trial": {"warmup_steps": 1, "measure_steps": 3, "timeout_s": 300, "env": {"OMP_NUM_THREADS": "1"}},
        "tracking": {"uri": "sqlite:///mlflow.db"},
        "study": {"storage": "sqlite:///optuna.db"},
        "output": "policy.yaml",
    }


def run_tuner(
    wl: Workload,
    fraction: float,
    budget_bytes: int,
    n_trials: int,
    workdir: Path,
    modes: Sequence[str] = MODES,
    compile_search: bool = False,
) -> TunerRun:
    """One `recompute-tune` session (the library call behind the CLI) on a recipe for this workload."""
    import optuna

    from tuner import recipe as recipe_mod
    from tuner.session import tune

    folder = workdir / f"{wl.name}-{round(fraction * 100)}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "recipe.yaml"
    recipe_dict = _recipe_dict(wl, budget_bytes, n_trials, f"compare-{folder.name}", modes, compile_search)
    path.write_text(yaml.safe_dump(recipe_dict, sort_keys=False))
    recipe = recipe_mod.load(path)
    started = dt.datetime.now()
    t0 = time.perf_counter()
    summary = tune(recipe, handle_signals=False)
    wall = time.perf_counter() - t0
    ran = sorted((r for r in summary.records if r.ran), key=lambda r: r.number)
    table = [r.to_dict() for r in ran]
    best = summary.best
    promoted = summary.status in ("promoted", "current") and best is not None
    to_trials = to_seconds = None
    if best is not None and best.throughput:
        # Completion times from the Optuna study: the session does not keep them itself.
        study = optuna.load_study(study_name=summary.study, storage=str(recipe.study.storage))
        done = {t.number: t.datetime_complete for t in study.get_trials(deepcopy=False)}
        running = 0.0
        for i, rec in enumerate(ran, start=1):
            if rec.feasible and rec.throughput:
                running = max(running, rec.throughput)
            if running >= 0.98 * best.throughput:
                to_trials = i
                finished = done.get(rec.number)
                to_seconds = (finished - started).total_seconds() if finished is not None else None
                break
    return TunerRun(
        fraction,
        best.policy if promoted else None,
        summary.status,
        len(ran),
        to_trials,
        to_seconds,
        wall,
        list(summary.reasons),
        table,
    )


# --------------------------------------------------------------------------------------------- one workload


def _probe_sac_ilp() -> str:
    """Why torch's SAC ILP could not run here, or '' if its pipeline ran (one subprocess per mode)."""
    errors = []
    for mode in ("operator-level-benchmark", "operator-level-cost-model"):
        proc = subprocess.run(
            [sys.executable, str(Path(peers.__file__)), "sac-ilp-probe", mode],
            check=False,  # a failed probe is a result: its reason is read from the output below
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            res = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            errors.append(f"{mode}: probe crashed: {proc.stderr.strip().splitlines()[-1:]}")
            continue
        if res["ok"]:
            return ""
        errors.append(f"{mode}: {res['error']}" if res["stage"] != "import" else res["error"])
    return "; ".join(dict.fromkeys(errors))


@dataclasses.dataclass
class _Methods:
    """One workload's configurations by method: the peers, and per budget the planner's and the tuner's."""

    none: Config
    full: Config
    every: dict[int, Config]
    selective: Config
    op_sac: Config
    sqrt_n: Config
    compiled: dict[float, Config]
    compile_note: str
    planned: dict[float, Config | str]
    tuned: dict[float, TunerRun]
    tuned_cfg: dict[float, Config]


class _WorkloadRun:
    """One workload's configurations, each measured for its peak when first added (by key)."""

    def __init__(self, wl: Workload, args: argparse.Namespace, log: Callable[[str], None]) -> None:
        self.wl, self.args, self.log = wl, args, log
        self.names = layer_names(_model(wl))
        self.configs: dict[str, Config] = {}

    def add(self, cfg: Config) -> Config:
        if cfg.key not in self.configs:
            cfg.peak_bytes = measure_peak(self.wl, cfg)
            self.configs[cfg.key] = cfg
        return self.configs[cfg.key]

    def policy_cfg(self, label: str, policy: RecomputePolicy, plugin: bool = False) -> Config:
        # The plugin's own policies (planner, tuned) run as RecomputeCallback runs them by default,
        # gradients freed at batch start; the same policy as a peer (full, every-k) runs in Lightning's order.
        key = f"policy:{policy.fingerprint()}" + (":frees-grads" if plugin else "")
        return self.add(_policy_config(key, label, policy, frees_grads=plugin))

    def compiled(self) -> tuple[dict[float, Config], str]:
        """Inductor at each budget's fraction, where the workload is chosen for it; else why not."""
        wl, args = self.wl, self.args
        if not (wl.name in args.compile_workloads or "all" in args.compile_workloads):
            return {}, (
                "not run for this workload: inductor compiles each budget's graph for ~70 s on this machine; "
                "--compile-workloads all runs it everywhere"
            )
        compiled: dict[float, Config] = {}
        for f in args.budgets:
            cfg = Config(
                f"compile:{f}",
                f"compile(budget={f:g})",
                prepare=functools_partial(peers.apply_compile, budget=f, metered=False),
                compile_metered=lambda m, meter_of, f=f: peers.apply_compile(m, f, metered=True, meter_of=meter_of),
            )
            try:
                compiled[f] = self.add(cfg)
            except Exception as err:  # noqa: BLE001 - reported as the row's note
                return compiled, f"could not run: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        return compiled, ""

    def planned(self, budgets: dict[float, int], modes: list[str]) -> tuple[dict[float, Config | str], float]:
        """The planner: one measured profile of this workload, then the exact solver per budget; and
        the profile's seconds."""
        from lightning_recompute.planner import BudgetError, Planner
        from lightning_recompute.profile import profile_model

        t = time.perf_counter()
        profile = profile_model(_model(self.wl), _batch(self.wl), modes=modes, repeats=self.args.profile_repeats)
        profile_s = time.perf_counter() - t
        planner = Planner(profile)
        planned: dict[float, Config | str] = {}
        for f, b in budgets.items():
            try:
                plan = planner.solve(b, modes=modes)
                planned[f] = self.policy_cfg(f"planner {plan.short()}", plan.policy, plugin=True)
            except BudgetError as err:
                planned[f] = f"nothing predicted to fit: {err}"
        return planned, profile_s

    def tuned(
        self, budgets: dict[float, int], modes: list[str], workdir: Path
    ) -> tuple[dict[float, TunerRun], dict[float, Config]]:
        """A tuning session per budget, and the configuration of each promoted policy."""
        wl, args = self.wl, self.args
        tuned: dict[float, TunerRun] = {}
        tuned_cfg: dict[float, Config] = {}
        for f, b in budgets.items():
            self.log(f"  tuner at {f:.0%} ({b / 2**20:.2f} MiB), {args.trials} trials ...")
            compile_search = wl.name in args.compile_search or "all" in args.compile_search
            tr = run_tuner(wl, f, b, args.trials, workdir, modes, compile_search)
            tuned[f] = tr
            if tr.policy is not None:
                label = f"tuned {tr.policy.short(self.names)}" + (" +compile" if tr.policy.compile else "")
                tuned_cfg[f] = self.policy_cfg(label, tr.policy, plugin=True)
            self.log(
                f"    {tr.status}: {tr.trials} trials, {tr.wall_s:.0f} s; within 2% after {tr.trials_to_2pct} trials"
            )
        return tuned, tuned_cfg


def run_workload(
    wl: Workload, args: argparse.Namespace, sac_ilp_error: str, workdir: Path, log: Callable[[str], None]
) -> dict[str, Any]:
    """Every method's configuration of ``wl`` measured (peaks, then interleaved step times), one row
    per method and budget, and the record the report and plots read."""
    t_start = time.perf_counter()
    run = _WorkloadRun(wl, args, log)
    names, n = run.names, len(run.names)
    none = run.policy_cfg("none", RecomputePolicy.uniform("none"))
    none_peak = int(none.peak_bytes or 0)
    budgets = {f: int(f * none_peak) for f in args.budgets}
    log(f"{wl.name}: {n} layers, {wl.tokens} tokens/step, no-recompute peak {none_peak / 2**20:.2f} MiB")
    full = run.policy_cfg("full", RecomputePolicy.uniform("full"))
    every = {k: run.policy_cfg(f"every-{k}", RecomputePolicy.every_kth(names, k, "full")) for k in range(2, n + 1)}
    every[1] = full
    selective = run.policy_cfg("selective-attn", RecomputePolicy.uniform("selective", selective_save=MEGATRON_SAVE))
    op_sac = run.add(Config("op-sac", "op-sac", lambda m, _meter: peers.apply_op_sac(m)))
    seg = peers.sqrt_segment_size(n)
    sqrt_n = run.add(Config("sqrt-n", f"sqrt-n (segments of {seg})", lambda m, _meter: peers.apply_sqrt_segments(m)))
    compiled, compile_note = run.compiled()
    modes = [*MODES, *(FAMILY_MODES if args.families else ())]
    planned, profile_s = run.planned(budgets, modes)
    tuned, tuned_cfg = run.tuned(budgets, modes, workdir)
    methods = _Methods(none, full, every, selective, op_sac, sqrt_n, compiled, compile_note, planned, tuned, tuned_cfg)

    log(f"  timing {len(run.configs)} configurations x {args.rounds} rounds x {args.steps} steps ...")
    measure_times(wl, list(run.configs.values()), args.rounds, args.steps, log)
    rows = [r for f, b in budgets.items() for r in _budget_rows(wl, n, methods, f, b, sac_ilp_error)]
    return {
        "workload": dataclasses.asdict(wl),
        "layers": names,
        "none_peak_bytes": none_peak,
        "budgets": {str(f): b for f, b in budgets.items()},
        "profile_s": profile_s,
        "rows": [dataclasses.asdict(r) for r in rows],
        "tuner": {
            str(f): dataclasses.asdict(tr) | {"policy": None if tr.policy is None else tr.policy.to_dict()}
            for f, tr in tuned.items()
        },
        "configs": {
            k: {"label": c.label, "peak_bytes": c.peak_bytes, "step_times_s": c.step_times, "error": c.error}
            for k, c in run.configs.items()
        },
        "wall_s": time.perf_counter() - t_start,
    }


def _budget_rows(wl: Workload, n: int, m: _Methods, f: float, b: int, sac_ilp_error: str) -> list[Row]:
    """One row per method at the budget fraction ``f`` (limit ``b`` bytes), each with its ratio to the tuned row."""
    rows: list[Row] = []

    def row(method: str, cfg: Config | None, detail: str = "", note: str = "") -> None:
        if cfg is None:
            rows.append(Row(method, f, None, detail, note=note))
            return
        st = cfg.step_time()
        rows.append(
            Row(
                method,
                f,
                cfg.key,
                detail or cfg.label,
                cfg.peak_bytes,
                wl.tokens / st if st else None,
                None if cfg.peak_bytes is None else cfg.peak_bytes <= b,
                note=cfg.error or note,
            )
        )

    row("none", m.none)
    row("full", m.full)
    fitting = [k for k, c in m.every.items() if c.peak_bytes is not None and c.peak_bytes <= b]
    # Fewest recomputed layers first (ceil(n / k)); among equals, the smaller peak.
    best_k = min(fitting, key=lambda k: (math.ceil(n / k), m.every[k].peak_bytes)) if fitting else None
    if best_k is None:
        row("every-k", None, "every-k", "no k fits (not even k=1, full on every layer)")
    else:
        row("every-k", m.every[best_k], f"every-{best_k} ({math.ceil(n / best_k)} of {n} layers full)")
    row("selective-attn", m.selective)
    row("op-sac", m.op_sac)
    row("sqrt-n", m.sqrt_n)
    if f in m.compiled:
        row(
            "compile",
            m.compiled[f],
            note="peak: same partition run op by op (inductor's own buffers bypass the ledger)",
        )
    else:
        row("compile", None, "compile", m.compile_note)
    row("torch-sac-ilp", None, "torch-sac-ilp", f"could not run: {sac_ilp_error}" if sac_ilp_error else "")
    p = m.planned[f]
    if isinstance(p, Config):
        row("planner", p)
    else:
        row("planner", None, "planner", p)
    tr = m.tuned[f]
    if f in m.tuned_cfg:
        row(
            "tuned",
            m.tuned_cfg[f],
            note=f"{tr.trials} trials; within 2% of its best after {tr.trials_to_2pct} "
            f"trials / {_s(tr.seconds_to_2pct)}; session {tr.wall_s:.0f} s",
        )
    else:
        row("tuned", None, "tuned", f"nothing promoted ({tr.status}): {'; '.join(tr.reasons)[:300]}")
    mine = rows[-1]
    for r in rows:
        if r.tokens_per_s and mine.tokens_per_s:
            r.ratio = r.tokens_per_s / mine.tokens_per_s
    return rows


def functools_partial(fn: Callable[..., None], **kwargs: Any) -> Callable[[ReferenceGPT, Any], None]:
    """``(model, meter_of) -> fn(model, **kwargs)``: a preparation that ignores the meter."""
    return lambda model, _meter_of: fn(model, **kwargs)


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.0f} s"


# --------------------------------------------------------------------------------------------- reporting


def verdict(rows: Sequence[dict[str, Any]], tolerance: float) -> str:
    """Whether the tuned row is at least as fast as every fitting peer (within ``tolerance``)."""
    tuned = next((r for r in rows if r["method"] == "tuned"), None)
    peers_fit = [r for r in rows if r["method"] in PEERS and r["fits"] and r["tokens_per_s"]]
    if tuned is None or not tuned["tokens_per_s"]:
        return "no tuned policy"
    if not tuned["fits"]:
        return "tuned policy does not fit"
    if not peers_fit:
        return "ok (no peer fits)"
    best = max(peers_fit, key=lambda r: r["tokens_per_s"])
    gap = tuned["tokens_per_s"] / best["tokens_per_s"] - 1
    if gap >= -tolerance:
        return f"ok ({gap:+.1%} vs best fitting peer {best['method']})"
    return f"SLOWER by {-gap:.1%} than {best['method']}"


def format_report(result: dict[str, Any], tolerance: float) -> str:
    lines = [
        f"# bench/compare.py {' '.join(result['argv'])}",
        f"# {result['machine']}",
        f"# {result['versions']}",
        f"# {result['settings']}",
        f"# torch SAC ILP: {result['sac_ilp'] or 'ran'}",
        "",
    ]
    for w in result["workloads"]:
        wl = w["workload"]
        lines.append(
            f"## {wl['name']}: {wl['model']}, batch {wl['batch']}; no-recompute peak "
            f"{w['none_peak_bytes'] / 2**20:.2f} MiB; {w['wall_s']:.0f} s"
        )
        for f, b in w["budgets"].items():
            rows = [r for r in w["rows"] if str(r["budget"]) == f]
            lines.append(f"### budget {float(f):.0%} = {b / 2**20:.2f} MiB: {verdict(rows, tolerance)}")
            lines.append(f"{'method':<15} {'peak MiB':>9} {'fits':>5} {'tokens/s':>9} {'vs tuned':>8}  detail / note")
            for r in rows:
                peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.2f}"
                fits = "-" if r["fits"] is None else ("yes" if r["fits"] else "NO")
                tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}"
                ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
                note = r["detail"] + (f"; {r['note']}" if r["note"] else "")
                lines.append(f"{r['method']:<15} {peak:>9} {fits:>5} {tps:>9} {ratio:>8}  {note}")
            lines.append("")
    return "\n".join(lines)


def plot_workload(w: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    markers = dict(zip(METHODS, "osD^v<>Px*", strict=True))  # one glyph per method
    seen: set[tuple[str, str | None]] = set()
    colors = {"0.3": "tab:red", "0.5": "tab:orange", "0.7": "tab:green"}
    for r in w["rows"]:
        if r["peak_bytes"] is None or r["tokens_per_s"] is None or (r["method"], r["config"]) in seen:
            continue
        seen.add((r["method"], r["config"]))
        budget_bound = r["method"] in ("every-k", "compile", "planner", "tuned")
        color = colors.get(str(r["budget"]), "tab:blue") if budget_bound else "tab:blue"
        ax.scatter(
            r["peak_bytes"] / 2**20,
            r["tokens_per_s"],
            marker=markers[r["method"]],
            s=90 if r["method"] == "tuned" else 50,
            color=color,
            label=f"{r['method']}" + (f" @{float(r['budget']):.0%}" if budget_bound else ""),
        )
    for f, b in w["budgets"].items():
        ax.axvline(b / 2**20, color=colors.get(f, "gray"), ls="--", lw=1)
        ax.text(b / 2**20, ax.get_ylim()[0], f" {float(f):.0%}", color=colors.get(f, "gray"), va="bottom")
    ax.set_xlabel("measured peak memory (MiB, exact CPU ledger)")
    ax.set_ylabel("throughput (tokens/s, median)")
    ax.set_title(f"{w['workload']['name']}: each method vs budgets (dashed); tuned = large stars")
    ax.legend(fontsize=7, ncol=2, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _versions() -> str:
    import lightning
    import mlflow
    import optuna

    return (
        f"python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}, "
        f"optuna {optuna.__version__}, mlflow {mlflow.__version__}"
    )


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, {platform.system()} "
        f"{platform.release()}, load average at start {load:.1f}"
    )


def _arguments(argv: Sequence[str] | None) -> tuple[argparse.Namespace, tuple[Workload, ...], str]:
    """The command line with the size's defaults filled in, the workloads to run, and the results' tag.

    Long because it is a list: one declaration per option, read top to bottom as ``--help`` prints them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="one small workload, fewer rounds and trials")
    size.add_argument("--smoke", action="store_true", help="a tiny workload, one budget: the test's version")
    parser.add_argument("--budgets", type=float, nargs="+", default=None, help="fractions of the no-recompute peak")
    parser.add_argument(
        "--workloads", nargs="+", default=None, help="names of workloads to run (default: all of the size)"
    )
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration per round")
    parser.add_argument("--trials", type=int, default=None, help="tuner trials per budget")
    parser.add_argument("--profile-repeats", type=int, default=3)
    parser.add_argument(
        "--compile-workloads",
        nargs="*",
        default=None,
        help="workloads that run torch.compile (default: the first one in full and quick runs; 'all')",
    )
    parser.add_argument(
        "--compile-search",
        nargs="*",
        default=None,
        help="workloads whose tuner searches compile: [false, true] (default: the first one in full runs; 'all')",
    )
    parser.add_argument(
        "--families",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan and tune over the save-list families too (default: on, off for --smoke, which CI runs)",
    )
    parser.add_argument("--tolerance", type=float, default=0.02, help="noise allowed before a row counts as slower")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results)")
    parser.add_argument("--plots", type=Path, default=None, help="plot folder (default docs/)")
    args = parser.parse_args(argv)

    if args.smoke:
        workloads, defaults = (
            SMOKE_WORKLOADS,
            dict(budgets=[0.7], rounds=1, steps=1, trials=2, compile=[], compile_search=[], families=False),
        )
        tag = "smoke"
    elif args.quick:
        workloads, defaults = (
            QUICK_WORKLOADS,
            dict(budgets=list(BUDGETS), rounds=3, steps=2, trials=4, compile=[], compile_search=[], families=True),
        )
        tag = "quick"
    else:
        workloads, defaults = (
            FULL_WORKLOADS,
            dict(
                budgets=list(BUDGETS),
                rounds=5,
                steps=3,
                trials=5,
                compile=[FULL_WORKLOADS[0].name],
                compile_search=[FULL_WORKLOADS[0].name],
                families=True,
            ),
        )
        tag = ""
    if args.workloads:
        workloads = tuple(w for w in workloads if w.name in args.workloads)
        if not workloads:
            parser.error("--workloads: no such workload in this size")
    args.budgets = args.budgets or defaults["budgets"]
    args.rounds = args.rounds or defaults["rounds"]
    args.steps = args.steps or defaults["steps"]
    args.trials = args.trials or defaults["trials"]
    args.compile_workloads = defaults["compile"] if args.compile_workloads is None else args.compile_workloads
    args.compile_search = defaults["compile_search"] if args.compile_search is None else args.compile_search
    args.families = defaults["families"] if args.families is None else args.families
    return args, workloads, tag


def _quiet() -> None:
    """One torch thread, and only errors from the libraries that talk."""
    # One thread: on a shared 2-core machine two threads fight other jobs and step times triple;
    # the tuner's trials run with OMP_NUM_THREADS=1 too (see _recipe_dict).
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in (
        "lightning",
        "lightning.pytorch",
        "lightning.fabric",
        "mlflow",
        "optuna",
        "alembic",
        "torch._dynamo",
        "torch._inductor",
    ):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: Sequence[str] | None = None) -> int:
    args, workloads, tag = _arguments(argv)
    _quiet()
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {msg}", file=sys.stderr, flush=True)

    out_dir = args.out or ROOT / "bench" / "results"
    plot_dir = args.plots or ROOT / "docs"
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_dir.mkdir(parents=True, exist_ok=True)
    sac_ilp_error = _probe_sac_ilp()
    log(f"torch SAC ILP: {sac_ilp_error or 'runs'}")
    results = []
    with tempfile.TemporaryDirectory(prefix="compare-tuner-") as tmp:
        for wl in workloads:
            # Lightning prints per-fit banners to stdout; the report is what belongs there.
            with contextlib.redirect_stdout(io.StringIO()):
                results.append(run_workload(wl, args, sac_ilp_error, Path(tmp), log))
    result = {
        "argv": list(argv if argv is not None else sys.argv[1:]),
        "machine": _machine(),
        "versions": _versions(),
        "settings": (
            f"budgets {args.budgets}, rounds {args.rounds} x {args.steps} steps (+1 re-warm step per visit), "
            f"tuner trials {args.trials} per budget (1 warm-up + 3 measured steps each, margin 0), "
            f"save-list families {'on' if args.families else 'off'}, compile searched on "
            f"{', '.join(args.compile_search) or 'no workload'}, "
            f"1 torch thread, total {time.perf_counter() - started:.0f} s"
        ),
        "sac_ilp": sac_ilp_error,
        "workloads": results,
    }
    stem = "compare" + (f"-{tag}" if tag else "")
    text = format_report(result, args.tolerance)
    (out_dir / f"{stem}.txt").write_text(text + "\n")
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    if not args.smoke:
        for w in results:
            plot_workload(w, plot_dir / f"compare_{w['workload']['name']}.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
