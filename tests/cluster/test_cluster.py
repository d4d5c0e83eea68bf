"""``recompute-tune`` across "machines": workers in separate folders on one PostgreSQL study and one MLflow server.

Every worker, and the training job that reads the promoted policy, is a subprocess with its own
working directory and its own copy of the recipe; they share nothing but the two servers (the
`postgres`, `own_postgres` and `mlflow_server` fixtures of ``tests/conftest.py``). Results are
read back through Optuna's and MLflow's public APIs only, as another machine would.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from mlflow import MlflowClient

from lightning_recompute.policy import RecomputePolicy
from tests.helpers import REPO, child_env

QUICKSTART = REPO / "recipes" / "quickstart.yaml"
DEADLINE_S = 800  # a hang deadline, not a speed bound: three workers on two cores took ~330 s pinned to one

# The quickstart recipe, made as small as a real run gets: three blocks of width 32, sequence 32.
TINY_MODEL = {"n_layer": 3, "n_embd": 32, "seq_len": 32, "n_head": 2, "dropout": 0.0}
TINY_DATA = {"batch_size": 4, "num_batches": 8}
TINY_TRIAL = {"warmup_steps": 1, "measure_steps": 2, "timeout_s": 120, "env": {"OMP_NUM_THREADS": "1"}}

pytestmark = pytest.mark.slow


def write_recipe(folder: Path, *, storage: str, tracking: str, n_trials: int, name: str) -> Path:
    """A copy of the quickstart recipe in ``folder``, made tiny, pointing at the two servers."""
    recipe = yaml.safe_load(QUICKSTART.read_text(encoding="utf-8"))
    recipe["name"] = name
    recipe["model"]["init_args"].update(TINY_MODEL)
    recipe["data"]["init_args"].update(TINY_DATA)
    recipe["budget"] = {"value": "64MiB"}
    recipe["trial"] = TINY_TRIAL
    recipe["search"] = {**recipe["search"], "n_trials": n_trials, "seed": 0}
    recipe["study"] = {"storage": storage}
    recipe["tracking"] = {"uri": tracking}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    return path


def tune(folder: Path, *args: str) -> subprocess.Popen[str]:
    """``recompute-tune recipe.yaml ARGS`` started in ``folder``."""
    return subprocess.Popen(
        [sys.executable, "-m", "tuner", "recipe.yaml", *args],
        cwd=folder,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = DEADLINE_S) -> tuple[str, str]:
    """The process's (stdout, stderr), killing it at the deadline."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"recompute-tune did not finish within {timeout:.0f} s; stderr tail:\n{err[-3000:]}")


def summary_json(out: str) -> dict[str, Any]:
    """The ``--format json`` summary: stdout is exactly one JSON document.

    MLflow's client would print "View run ... at: http://..." to stdout at every run end with a
    tracking server; the tuner sets MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT so nothing else is there.
    """
    return dict(json.loads(out))


def the_study(storage: str) -> optuna.Study:
    names = optuna.get_all_study_names(storage)
    assert len(names) == 1, names
    return optuna.load_study(study_name=names[0], storage=storage)


def asked_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials a worker took (the enqueued seeds nobody reached stay WAITING and have no MLflow run)."""
    return [t for t in study.get_trials(deepcopy=False) if t.state != optuna.trial.TrialState.WAITING]


def measured(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials that ran a policy (what ``n_trials`` counts): neither skipped, duplicate, interrupted nor abandoned."""
    return [
        t
        for t in study.get_trials(deepcopy=False)
        if t.user_attrs.get("outcome") not in (None, "skipped", "duplicate", "interrupted", "abandoned")
    ]


def mlflow_runs(tracking: str, experiment: str) -> tuple[MlflowClient, Any, list[Any]]:
    client = MlflowClient(tracking)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r} on {tracking}"
    return client, exp, client.search_runs([exp.experiment_id], max_results=1000)


def promotions(runs: list[Any]) -> list[Any]:
    """The experiment's promotion decisions."""
    return [
        r
        for r in runs
        if r.data.tags.get("recompute.kind") == "decision" and r.data.tags.get("recompute.decision") == "promote"
    ]


# ---------------------------------------------------------------------------------------------- a training job


TRAIN = """
import sys
import lightning as L
from lightning_recompute import QUIET_TRAINER, RecomputeCallback
from lightning_recompute.reference import ReferenceGPT, SyntheticTokens

model_args, data_args, source = sys.argv[1], sys.argv[2], sys.argv[3]
import json
callback = RecomputeCallback(policy=source)
trainer = L.Trainer(
    accelerator="cpu", max_steps=1, callbacks=[callback], **QUIET_TRAINER,
)
trainer.fit(ReferenceGPT(**json.loads(model_args)), SyntheticTokens(**json.loads(data_args)))
print(json.dumps({"fingerprint": callback.policy.fingerprint(), "steps": trainer.global_step}))
"""


# ---------------------------------------------------------------------------------------------- three workers

N_WORKERS = 3
N_TRIALS = 5


@pytest.fixture(scope="module")
def three_workers(tmp_path_factory: pytest.TempPathFactory, postgres: Any, mlflow_server: str) -> dict[str, Any]:
    """Three ``recompute-tune`` processes, each in its own folder with its own recipe copy, on one study."""
    storage = postgres.create_database(f"w_{uuid.uuid4().hex[:12]}")
    name = f"three-{uuid.uuid4().hex[:8]}"
    folders = [tmp_path_factory.mktemp(f"machine{i}") for i in range(N_WORKERS)]
    recipes = [write_recipe(f, storage=storage, tracking=mlflow_server, n_trials=N_TRIALS, name=name) for f in folders]
    procs = [tune(folder, "--format", "json") for folder in folders]
    outputs = [finish(p) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    summaries = [summary_json(out) for out, _ in outputs]
    study = the_study(storage)
    _, exp, runs = mlflow_runs(mlflow_server, name)
    return {
        "folders": folders,
        "recipe": recipes[0],
        "name": name,
        "tracking": mlflow_server,
        "summaries": summaries,
        "study": study,
        "experiment": exp,
        "runs": runs,
    }


def test_workers_share_the_study_without_measuring_a_policy_twice(three_workers: dict[str, Any]) -> None:
    study: optuna.Study = three_workers["study"]
    ran = measured(study)
    keys = [(t.user_attrs["policy_fingerprint"], t.user_attrs.get("micro_batch")) for t in ran]
    assert len(keys) == len(set(keys)), f"measured twice: {[k for k, n in Counter(keys).items() if n > 1]}"
    params = [tuple(sorted(t.params.items())) for t in ran]
    assert len(params) == len(set(params))
    # Every worker took part, and none left a trial running.
    assert len({t.user_attrs.get("worker") for t in ran}) == N_WORKERS
    assert not study.get_trials(states=(optuna.trial.TrialState.RUNNING,))


def test_every_trial_is_a_nested_run_of_exactly_one_session(three_workers: dict[str, Any]) -> None:
    study: optuna.Study = three_workers["study"]
    runs = three_workers["runs"]
    sessions = {r.info.run_id for r in runs if r.data.tags.get("recompute.kind") == "session"}
    assert len(sessions) == N_WORKERS  # each worker's own session run: another's is RUNNING when it starts
    trial_runs = [r for r in runs if r.data.tags.get("recompute.kind") == "trial"]
    numbers = Counter(int(r.data.params["trial_number"]) for r in trial_runs)
    assert sorted(numbers) == sorted(t.number for t in asked_trials(study))
    assert set(numbers.values()) == {1}, "a trial was logged by more than one session"
    assert {r.data.tags["mlflow.parentRunId"] for r in trial_runs} <= sessions
    assert not [r for r in runs if r.info.status == "RUNNING"]


def test_workers_together_measure_exactly_n_trials(three_workers: dict[str, Any]) -> None:
    counts = Counter(t.user_attrs.get("outcome") for t in asked_trials(three_workers["study"]))
    assert len(measured(three_workers["study"])) == N_TRIALS, counts


def test_exactly_one_worker_promotes_and_every_worker_agrees_on_the_good_policy(
    three_workers: dict[str, Any],
) -> None:
    promoted = promotions(three_workers["runs"])
    assert len(promoted) == 1, [r.data.tags.get("recompute.decision_seq") for r in promoted]
    good = three_workers["experiment"].tags["recompute.good_run_id"]
    files = {RecomputePolicy.load(folder / "policy.yaml").fingerprint() for folder in three_workers["folders"]}
    assert files == {promoted[0].data.tags["recompute.policy_fingerprint"]}
    assert good


def test_workers_keep_no_store_and_a_training_job_elsewhere_loads_the_good_policy_from_the_server(
    three_workers: dict[str, Any], tmp_path: Path
) -> None:
    # Every worker's folder holds no store of its own: everything went to the servers.
    for folder in three_workers["folders"]:
        assert not {"mlflow.db", "optuna.db", "mlruns", "mlartifacts"} & set(os.listdir(folder)), folder
    client = MlflowClient(three_workers["tracking"])
    good = three_workers["experiment"].tags["recompute.good_run_id"]
    assert "policy.yaml" in [a.path for a in client.list_artifacts(good)]
    promoted = RecomputePolicy.load(three_workers["folders"][0] / "policy.yaml")

    # A training job in another folder applies the promoted policy straight from the tracking server.
    recipe = yaml.safe_load(three_workers["recipe"].read_text(encoding="utf-8"))
    model_args = recipe["model"]["init_args"]
    # The data must fit the model: SyntheticTokens defaults to 64 tokens, this model has 32 positions.
    data_args = {**recipe["data"]["init_args"], **{k: model_args[k] for k in ("vocab_size", "seq_len")}}
    source = f"mlflow:{three_workers['name']}@{three_workers['tracking']}"
    train = subprocess.run(
        [sys.executable, "-c", TRAIN, json.dumps(model_args), json.dumps(data_args), source],
        check=False,
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    loaded = json.loads(train.stdout.strip().splitlines()[-1])
    assert loaded == {"fingerprint": promoted.fingerprint(), "steps": 1}


# ---------------------------------------------------------------------------------------------- the database going away

KEPT_POLICY = "version: 1\nlayers:\n  blocks.*: full\n"


def wait_for_line(proc: subprocess.Popen[str], prefix: str, timeout: float = DEADLINE_S) -> None:
    """Read the process's stdout until a line starts with ``prefix`` (fails at EOF or the deadline)."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(prefix):
            return
        if time.monotonic() > deadline:
            break
    proc.kill()
    _, err = proc.communicate(timeout=30)
    pytest.fail(f"no line starting {prefix!r} within {timeout:.0f} s; stderr tail:\n{err[-3000:]}")


def test_the_study_database_going_away_fails_clearly_and_a_rerun_resumes(
    tmp_path: Path, own_postgres: Any, mlflow_server: str
) -> None:
    storage = own_postgres.create_database("study")
    name = f"gone-{uuid.uuid4().hex[:8]}"
    worker = tmp_path / "worker"
    write_recipe(worker, storage=storage, tracking=mlflow_server, n_trials=4, name=name)
    (worker / "policy.yaml").write_text(KEPT_POLICY, encoding="utf-8")

    proc = tune(worker, "--no-plan")
    try:
        wait_for_line(proc, "[1/4]")
        own_postgres.stop()
        _, err = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    own_postgres.start()
    (tmp_path / "first-session.stderr").write_text(err, encoding="utf-8")  # kept for a look after a failure

    # The contract: a clear error that names the storage, no traceback, the policy file untouched.
    assert proc.returncode == 3, err[-3000:]  # a store failed (docs/TUNER.md's exit codes)
    assert "study.storage" in err and "127.0.0.1" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert (worker / "policy.yaml").read_text(encoding="utf-8") == KEPT_POLICY

    # Once the database is back, a rerun finishes the study without measuring anything twice.
    again = tune(worker, "--search-only", "--no-plan")
    _, err = finish(again)
    assert again.returncode == 0, err[-3000:]
    study = the_study(storage)
    ran = measured(study)
    keys = [(t.user_attrs["policy_fingerprint"], t.user_attrs.get("micro_batch")) for t in ran]
    assert len(ran) >= 4 and len(keys) == len(set(keys))


# ---------------------------------------------------------------------------------------------- no driver

BLOCK_PSYCOPG = """
import runpy, sys

class NoPsycopg:
    # Stands in for an environment without the [postgres] extra: psycopg cannot be imported.
    def find_spec(self, name, path=None, target=None):
        if name == "psycopg" or name.startswith(("psycopg.", "psycopg_")) or name == "psycopg2":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoPsycopg())
sys.argv = ["recompute-tune", *sys.argv[1:]]
runpy.run_module("tuner", run_name="__main__", alter_sys=True)
"""


def test_a_postgresql_storage_without_the_driver_names_the_extra(tmp_path: Path) -> None:
    # No server is needed: the driver is imported before any connection is tried.
    write_recipe(
        tmp_path,
        storage="postgresql://postgres@127.0.0.1:9/study",
        tracking=f"sqlite:///{tmp_path / 'mlflow.db'}",
        n_trials=1,
        name="nodriver",
    )
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_PSYCOPG, "recipe.yaml", "--no-plan"],
        check=False,
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "lightning-recompute[postgres]" in proc.stderr and "psycopg" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------- a worker dying

GRACE_S = 8.0
# Makes the killed worker another "machine" to the survivor (another host name), so the survivor
# can only tell it is dead from its silence: the heartbeat and the grace period, as across hosts.
OTHER_MACHINE = "import socket\nsocket.gethostname = lambda: 'machine-b.example'\n"


def parent_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    children = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if int(stat[stat.rfind(")") + 2 :].split()[1]) == pid:
            children.append(int(entry.name))
    return children


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the trial's process through /proc")
def test_a_worker_killed_mid_trial_is_failed_after_the_grace_period_and_its_candidate_retried(
    tmp_path: Path, postgres: Any, mlflow_server: str
) -> None:
    storage = postgres.create_database(f"d_{uuid.uuid4().hex[:12]}")
    name = f"dies-{uuid.uuid4().hex[:8]}"
    survivor_dir, doomed_dir, site = tmp_path / "a", tmp_path / "b", tmp_path / "site"
    for folder in (survivor_dir, doomed_dir):
        write_recipe(folder, storage=storage, tracking=mlflow_server, n_trials=4, name=name)
    site.mkdir()
    (site / "sitecustomize.py").write_text(OTHER_MACHINE, encoding="utf-8")
    timing = {"RECOMPUTE_TUNE_GRACE_S": str(GRACE_S), "RECOMPUTE_TUNE_HEARTBEAT_S": "1"}
    doomed_env = {**child_env(), **timing}
    doomed_env["PYTHONPATH"] = os.pathsep.join((str(site), doomed_env["PYTHONPATH"]))
    doomed = subprocess.Popen(
        [sys.executable, "-m", "tuner", "recipe.yaml", "--search-only", "--no-plan"],
        cwd=doomed_dir,
        env=doomed_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    # Both work at once; the survivor goes on while the doomed one dies mid-trial.
    survivor = subprocess.Popen(
        [sys.executable, "-m", "tuner", "recipe.yaml", "--format", "json", "--no-plan"],
        cwd=survivor_dir,
        env={**child_env(), **timing},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Wait until the doomed worker runs a trial, then kill it and its children's process groups:
        # a fresh trial worker's, or the fork server's (its forked trial worker follows it).
        deadline = time.monotonic() + DEADLINE_S
        victim = None
        while victim is None and time.monotonic() < deadline and doomed.poll() is None:
            names = optuna.get_all_study_names(storage)
            if names:
                study = optuna.load_study(study_name=names[0], storage=storage)
                running = [
                    t
                    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
                    if (t.user_attrs.get("owner") or {}).get("host") == "machine-b.example"
                ]
                workers = parent_of(doomed.pid)
                if running and workers:
                    victim = running[0]
                    for worker in workers:
                        os.killpg(worker, 9)
                    os.killpg(doomed.pid, 9)
            time.sleep(0.2)
        assert victim is not None, "the doomed worker never ran a trial"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(doomed.pid, 9)
        doomed.wait(timeout=60)

    out, err = finish(survivor)
    assert survivor.returncode == 0, err[-3000:]

    study = the_study(storage)
    dead = study.trials[victim.number]
    assert dead.state == optuna.trial.TrialState.FAIL and dead.user_attrs["outcome"] == "abandoned"
    assert "no heartbeat" in dead.user_attrs["reason"] and f"grace period {GRACE_S:g} s" in dead.user_attrs["reason"]
    key = victim.user_attrs["candidate_key"]
    retried = [t for t in measured(study) if t.user_attrs["candidate_key"] == key]
    assert len(retried) == 1 and retried[0].user_attrs["worker"].startswith(socket.gethostname())
    assert not study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
    assert len(measured(study)) == 4

    _, _, runs = mlflow_runs(mlflow_server, name)
    assert not [r for r in runs if r.info.status == "RUNNING"]
    trial_runs = [r for r in runs if r.data.tags.get("recompute.kind") == "trial"]
    (dead_run,) = [r for r in trial_runs if r.data.params.get("trial_number") == str(victim.number)]
    assert dead_run.info.status == "FAILED" and dead_run.data.tags["recompute.outcome"] == "abandoned"
    assert "owner died" in dead_run.data.tags["recompute.reason"]
    killed_sessions = [r for r in runs if r.data.tags.get("recompute.session_ended_by")]
    assert [r.info.status for r in killed_sessions] in (["KILLED"], ["FINISHED"])  # KILLED, or resumed after
    numbers = Counter(int(r.data.params["trial_number"]) for r in trial_runs)
    assert sorted(numbers) == sorted(t.number for t in asked_trials(study)) and set(numbers.values()) == {1}
    assert summary_json(out)["status"] in ("promoted", "current")


def test_workers_opening_a_fresh_database_together_all_get_the_storage(postgres_url: str) -> None:
    """Several workers creating Optuna's schema on an empty PostgreSQL database at once all succeed.

    SQLAlchemy's create_all checks, then creates, so the losers of the race used to fail with
    ``UniqueViolation ... CREATE TYPE studydirection`` before doing anything.
    """
    from concurrent.futures import ThreadPoolExecutor

    from tuner._stores import open_storage

    with ThreadPoolExecutor(max_workers=4) as pool:
        storages = list(pool.map(lambda _: open_storage(postgres_url), range(4)))
    assert len(storages) == 4
    optuna.create_study(study_name="after-the-race", storage=storages[0])
    assert optuna.get_all_study_names(postgres_url) == ["after-the-race"]
