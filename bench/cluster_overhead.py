"""Per-trial overhead of the study storage and the tracking store when N workers share them.

Each worker is a separate process running trivially short fake trials (no training and no sleep:
the "measurement" is arithmetic on the trial's parameters), so every second counted is storage or
tracking. Per trial it times the two halves the tuner pays between measurements:

  ask+tell   the Optuna calls of one tuner trial: count the measured trials, ask (12 layers, three
             modes each, TPE), write the candidate's user attributes, scan the study for a
             duplicate, write the result's attributes and constraint, tell
  mlflow     the MLflow calls of one tuner trial: create the nested run with its tags, log the
             per-layer params and the metrics in batches, the step-time series, the policy.yaml
             artifact, terminate the run

These mirror `tuner`'s ask/tell and trial logging call for call, through Optuna's and MLflow's
public APIs (the tuner's own modules are not imported, so this keeps working as they move).

Backends:
  postgres   Optuna on PostgreSQL, MLflow on a tracking server backed by PostgreSQL (the cluster setup)
  sqlite     Optuna on a SQLite file, MLflow on a SQLite file (the single-machine default)
  journal    Optuna on a journal file, MLflow on a SQLite file

The servers are started and stopped by the benchmark itself (``tests/servers.py``): PostgreSQL
binaries are needed (``apt-get install postgresql``) and, under root, the ``postgres`` user.

Run:  python bench/cluster_overhead.py [--workers 1 2 4 8] [--trials 20] [--compare-at 1 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.servers: the same server helpers the tests use

LAYERS = [f"blocks.{i}" for i in range(12)]
MODES = ("none", "selective", "full")
WORKER_DEADLINE_S = 1800


# ---------------------------------------------------------------------------------------------- one worker


def _fake_measurement(params: dict[str, str]) -> dict[str, float]:
    """A deterministic stand-in for a trial's figures: more recomputation, less memory and throughput."""
    full = sum(1 for m in params.values() if m == "full")
    selective = sum(1 for m in params.values() if m == "selective")
    peak = float((70 - 4 * full - 2 * selective) * 2**20)
    step = 0.5 + 0.03 * full + 0.01 * selective
    return {"peak_bytes": peak, "step_time_s": step, "throughput": 8 / step, "samples_per_s": 8 / step}


def run_worker(storage: str, study_name: str, tracking: str, experiment_id: str, trials: int) -> list[dict[str, float]]:
    """``trials`` fake trials against the stores; per trial the seconds of ask+tell and of MLflow logging."""
    import optuna
    from mlflow import MlflowClient
    from mlflow.entities import RunTag

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(
        study_name=study_name, storage=_optuna_storage(storage), sampler=optuna.samplers.TPESampler(seed=os.getpid())
    )
    client = MlflowClient(tracking)
    session = client.create_run(experiment_id, run_name="session", tags={"recompute.kind": "session"}).info.run_id
    out = []
    for _ in range(trials):
        t0 = time.perf_counter()
        trial, params, fingerprint = _ask(study)
        figures = _fake_measurement(params)
        _tell_attrs(trial, figures)
        t1 = time.perf_counter()
        run_id = _log_trial_run(client, experiment_id, session, study_name, trial.number, params, fingerprint, figures)
        t2 = time.perf_counter()
        # The tuner tells after logging (the trial's run id goes into the study): same calls, same cost.
        trial.set_user_attr("mlflow_run_id", run_id)
        study.tell(trial, figures["throughput"])
        t3 = time.perf_counter()
        out.append({"ask_tell_s": (t1 - t0) + (t3 - t2), "mlflow_s": t2 - t1})
    client.log_batch(session, tags=[RunTag("recompute.trials", str(trials))])
    client.set_terminated(session, "FINISHED")
    return out


_BUDGET = 48 * 2**20


def _ask(study: Any) -> tuple[Any, dict[str, str], str]:
    """As a session asks: the stop check, the ask, the candidate's attributes, the duplicate scan."""
    import optuna

    distributions: dict[str, optuna.distributions.BaseDistribution] = {
        f"layer.{name}": optuna.distributions.CategoricalDistribution(MODES) for name in LAYERS
    }
    sum(1 for t in study.get_trials(deepcopy=False) if t.user_attrs.get("outcome") == "ok")
    trial = study.ask(fixed_distributions=distributions)
    params = {k: str(v) for k, v in trial.params.items()}
    fingerprint = uuid.uuid5(uuid.NAMESPACE_OID, json.dumps(params, sort_keys=True)).hex[:16]
    attrs: tuple[tuple[str, Any], ...] = (
        ("candidate_key", f"{fingerprint}@default"),
        ("policy", params),
        ("policy_fingerprint", fingerprint),
        ("policy_short", "".join(m[0].upper() for m in params.values())),
        ("micro_batch", None),
        ("worker", f"{platform.node()}:{os.getpid()}"),
    )
    for key, value in attrs:
        trial.set_user_attr(key, value)
    study.get_trials(deepcopy=False)
    return trial, params, fingerprint


def _tell_attrs(trial: Any, figures: dict[str, float]) -> None:
    """As a session tells: the result's attributes and the constraint."""
    attrs = (
        ("outcome", "ok"),
        ("reason", None),
        ("predicted_peak_bytes", None),
        ("predicted_step_time_s", None),
        ("throughput", figures["throughput"]),
        ("throughput_unit", "samples/s"),
        ("peak_bytes", figures["peak_bytes"]),
        ("step_time_s", figures["step_time_s"]),
        ("wall_s", 1.0),
        ("peak_minus_budget", figures["peak_bytes"] - _BUDGET),
    )
    for key, value in attrs:
        trial.set_user_attr(key, value)
    trial.set_constraint("peak_minus_budget", figures["peak_bytes"] - _BUDGET)


def _log_trial_run(
    client: Any,
    experiment_id: str,
    session: str,
    study_name: str,
    number: int,
    params: dict[str, str],
    fingerprint: str,
    figures: dict[str, float],
) -> str:
    """The nested trial run, as the tuner's `SessionLog.log_trial` writes it; its run id."""
    from mlflow.entities import Metric, Param

    now = int(time.time() * 1000)
    short = "".join(m[0].upper() for m in params.values())
    tags = {
        "recompute.kind": "trial",
        "recompute.outcome": "ok",
        "recompute.policy_fingerprint": fingerprint,
        "mlflow.parentRunId": session,
        "recompute.study": study_name,
        "recompute.policy_short": short,
        "recompute.device": "cpu",
        "recompute.throughput_unit": "samples/s",
    }
    run_id: str = client.create_run(
        experiment_id, start_time=now - 1000, tags=tags, run_name=f"trial {number}"
    ).info.run_id
    run_params = [Param(k, v) for k, v in params.items()]
    run_params += [
        Param("micro_batch", "default"),
        Param("policy_fingerprint", fingerprint),
        Param("trial_number", str(number)),
    ]
    metrics = [Metric(f"measured_{k}", v, now, 0) for k, v in figures.items()] + [Metric("wall_s", 1.0, now, 0)]
    client.log_batch(run_id, params=run_params)
    client.log_batch(run_id, metrics=metrics)
    client.log_batch(run_id, metrics=[Metric("step_time_s", figures["step_time_s"], now, i) for i in range(4)])
    policy = "version: 1\nlayers:\n" + "".join(f"  {k.removeprefix('layer.')}: {v}\n" for k, v in params.items())
    client.log_text(run_id, policy, "policy.yaml")
    client.set_terminated(run_id, "FINISHED")
    return run_id


def _optuna_storage(url: str) -> Any:
    import optuna
    from optuna.storages.journal import JournalFileBackend

    if url.endswith(".log"):
        return optuna.storages.JournalStorage(JournalFileBackend(url))
    if url.startswith("sqlite:///"):
        # The tuner's SQLite timeout: workers wait for each other's writes instead of failing.
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 120}})
    return optuna.storages.RDBStorage(url)


# ---------------------------------------------------------------------------------------------- one configuration


def run_config(backend: str, n: int, trials: int, stores: dict[str, Any], folder: Path) -> list[dict[str, float]]:
    """N worker processes against fresh stores of ``backend``; every worker's per-trial timings."""
    import optuna
    from mlflow import MlflowClient

    tag = f"{backend}_{n}_{uuid.uuid4().hex[:6]}"
    if backend == "postgres":
        storage = stores["postgres"].create_database(f"optuna_{tag}")
        tracking = stores["mlflow"].url
    else:
        storage = (
            str(folder / f"optuna_{tag}.log") if backend == "journal" else f"sqlite:///{folder / f'optuna_{tag}.db'}"
        )
        tracking = f"sqlite:///{folder / f'mlflow_{tag}.db'}"
    optuna.create_study(storage=_optuna_storage(storage), study_name=tag, direction="maximize")
    client = MlflowClient(tracking)
    experiment_id = client.create_experiment(
        tag, artifact_location=(folder / f"artifacts_{tag}").as_uri() if backend != "postgres" else None
    )
    args = [sys.executable, __file__, "--worker", storage, tag, tracking, experiment_id, str(trials)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(n)
    ]
    timings = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=WORKER_DEADLINE_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{backend} N={n}: a worker did not finish within {WORKER_DEADLINE_S} s") from None
        if p.returncode != 0:
            raise RuntimeError(f"{backend} N={n}: a worker exited {p.returncode}:\n{err[-3000:]}")
        timings += json.loads(out.strip().splitlines()[-1])
    done = optuna.load_study(study_name=tag, storage=_optuna_storage(storage)).get_trials(deepcopy=False)
    if len(done) != n * trials or any(t.state != optuna.trial.TrialState.COMPLETE for t in done):
        raise RuntimeError(f"{backend} N={n}: expected {n * trials} complete trials, the study holds {len(done)}")
    return timings


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[1, 2, 4, 8], help="worker counts, against PostgreSQL"
    )
    parser.add_argument(
        "--compare-at", type=int, nargs="*", default=[1, 2], help="worker counts also run on sqlite and journal"
    )
    parser.add_argument("--trials", type=int, default=20, help="fake trials per worker")
    parser.add_argument("--server-workers", type=int, default=4, help="the MLflow server's uvicorn workers")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cluster_overhead.txt")
    parser.add_argument(
        "--worker", nargs=5, metavar=("STORAGE", "STUDY", "TRACKING", "EXPERIMENT_ID", "TRIALS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.worker:
        storage, study, tracking, experiment_id, trials = args.worker
        print(json.dumps(run_worker(storage, study, tracking, experiment_id, int(trials))))
        return 0

    from tests.servers import MlflowServer, PostgresCluster

    configs = [("postgres", n) for n in args.workers]
    configs += [(b, n) for b in ("sqlite", "journal") for n in args.compare_at]
    rows = []
    with (
        PostgresCluster() as pg,
        MlflowServer(pg.create_database("mlflow"), workers=args.server_workers) as server,
        tempfile.TemporaryDirectory() as tmp,
    ):
        stores = {"postgres": pg, "mlflow": server}
        # Unrecorded: each of the server's workers opens its store on its first requests (seconds).
        run_config("postgres", args.server_workers, 3, stores, Path(tmp))
        for backend, n in configs:
            timings = run_config(backend, n, args.trials, stores, Path(tmp))
            row: dict[str, Any] = {"backend": backend, "workers": n, "trials": len(timings)}
            for key in ("ask_tell_s", "mlflow_s"):
                values = [t[key] for t in timings]
                row[f"{key}_median"] = statistics.median(values)
                row[f"{key}_p90"] = _percentile(values, 0.9)
            total = [t["ask_tell_s"] + t["mlflow_s"] for t in timings]
            row["total_s_median"] = statistics.median(total)
            row["total_s_p90"] = _percentile(total, 0.9)
            rows.append(row)
            print(_line(row), flush=True)

    import mlflow
    import optuna

    header = (
        f"# bench/cluster_overhead.py --workers {' '.join(map(str, args.workers))} --compare-at "
        f"{' '.join(map(str, args.compare_at))} --trials {args.trials} --server-workers {args.server_workers}\n"
        f"# {platform.platform()}, {os.cpu_count()} CPUs (load average at the end: "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}), Python {platform.python_version()}, "
        f"optuna {optuna.__version__}, mlflow {mlflow.__version__}\n"
        "# seconds per trial; ask+tell = Optuna storage, mlflow = tracking (one nested run, 15 params, 9 metrics, "
        "policy.yaml)\n"
    )
    table = header + _head() + "\n" + "\n".join(_line(r) for r in rows) + "\n"
    print("\n" + table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


def _head() -> str:
    return (
        f"{'backend':<9} {'N':>2} {'trials':>6}  {'ask+tell med':>12} {'p90':>7}  "
        f"{'mlflow med':>10} {'p90':>7}  {'total med':>9} {'p90':>7}"
    )


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['backend']:<9} {r['workers']:>2} {r['trials']:>6}  "
        f"{r['ask_tell_s_median']:>12.3f} {r['ask_tell_s_p90']:>7.3f}  "
        f"{r['mlflow_s_median']:>10.3f} {r['mlflow_s_p90']:>7.3f}  {r['total_s_median']:>9.3f} {r['total_s_p90']:>7.3f}"
    )


if __name__ == "__main__":
    sys.exit(main())
