"""``recompute-tune`` end to end: real trial subprocesses on a tiny recipe, read back from MLflow and Optuna.

Each trial is a subprocess of a few seconds, so the recipe is as small as a real run gets (three
blocks of width 32, sequence 32, one warm-up and two measured steps) and the runs are short.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections import Counter
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from lightning_recompute.policy import RecomputePolicy
from tests.helpers import child_env
from tests.tuner.cli_run import Drain, command, run_cli, write_recipe
from tuner import cli
from tuner._search import SearchSpace, TuningStudy, inspect_layers, study_name
from tuner.recipe import load


def open_study(recipe_path: Path) -> TuningStudy:
    recipe = load(recipe_path)
    space = SearchSpace.for_layers(inspect_layers(recipe), recipe.search.modes)
    return TuningStudy.open(
        name=study_name(recipe, "cpu"),
        storage=str(recipe.study.storage),
        space=space,
        budget_bytes=recipe.budget.limit_bytes(None),
    )


def mlflow_runs(recipe_path: Path):
    recipe = load(recipe_path)
    client = MlflowClient(recipe.tracking.uri)
    exp = client.get_experiment_by_name(str(recipe.tracking.experiment))
    assert exp is not None
    return client, exp, client.search_runs([exp.experiment_id], max_results=1000)


@pytest.mark.slow
def test_tune_end_to_end_records_every_trial_in_mlflow_and_promotes(tmp_path):
    recipe_path = write_recipe(tmp_path)
    proc = run_cli(tmp_path, str(recipe_path), "--format", "json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["status"] == "promoted" and summary["exit_code"] == 0
    live = [line for line in proc.stderr.splitlines() if line.startswith("[")]
    assert len(live) == len(summary["trials"]) and "trial" in live[0] and "best" in live[0]

    # The promoted policy file is the race winner's policy, and its "vs" figures carry their intervals.
    best = summary["best"]
    assert Path(summary["policy_path"]) == tmp_path / "policy.yaml"
    assert RecomputePolicy.load(tmp_path / "policy.yaml") == RecomputePolicy.from_dict(best["policy"])
    measured = [t for t in summary["trials"] if t["outcome"] in ("ok", "over_budget")]
    assert len(measured) == 3
    race = summary["race"]
    assert race["outcome"] == "ok" and race["winner"] == best["policy_fingerprint"] and summary["chosen"]
    assert set(race["entrants"]) == {t["policy_fingerprint"] for t in measured if t["feasible"]}
    for figure in summary["vs"].values():
        assert figure["low"] <= figure["gain"] <= figure["high"] and "interleaved" in figure["text"]
    assert summary["vs"] and all(f["text"].endswith(" rounds)") for f in summary["vs"].values())

    # Everything is in MLflow: the session, one child per trial (params, metrics, outcome, policy), the decision.
    client, exp, runs = mlflow_runs(recipe_path)
    sessions = [r for r in runs if r.data.tags.get("recompute.kind") == "session"]
    assert [s.info.status for s in sessions] == ["FINISHED"]
    session_id = sessions[0].info.run_id
    children = [r for r in runs if r.data.tags.get("recompute.kind") == "trial"]
    assert all(r.data.tags["mlflow.parentRunId"] == session_id for r in children)
    assert sorted(int(r.data.params["trial_number"]) for r in children) == [t["number"] for t in summary["trials"]]
    for run in children:
        trial = next(t for t in summary["trials"] if t["number"] == int(run.data.params["trial_number"]))
        assert run.data.tags["recompute.outcome"] == (
            "skipped" if trial["outcome"] == "duplicate" else trial["outcome"]
        )
        assert {f"layer.blocks.{i}" for i in range(3)} <= set(run.data.params)
        assert run.data.params["policy_fingerprint"] == trial["policy_fingerprint"]
        assert "policy.yaml" in [a.path for a in client.list_artifacts(run.info.run_id)]
        if trial["outcome"] == "ok":
            assert run.data.metrics["measured_throughput"] == pytest.approx(trial["throughput"])
            assert run.data.metrics["measured_peak_bytes"] == trial["peak_bytes"]
    session_artifacts = {a.path for a in client.list_artifacts(session_id)}
    assert {"trials.json", "pareto.png", "best_policy.yaml", "race.json"} <= session_artifacts
    assert sessions[0].data.tags["recompute.race_winner"] == best["policy_fingerprint"]
    assert exp.tags["recompute.good_run_id"]
    assert not [r for r in runs if r.info.status == "RUNNING"]
    study = open_study(recipe_path)
    assert not study.running()

    # history reads the promotion back from MLflow alone.
    assert cli.main(["history", str(recipe_path)]) == 0


def test_bad_recipe_lists_every_problem_and_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("budget: lots\nsearch: {n_trials: 0, modez: [full]}\n", encoding="utf-8")
    assert cli.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "budget.value" in err and "search.n_trials" in err and "search.modez" in err


def test_schema_prints_the_recipe_json_schema(capsys):
    assert cli.main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert {"budget", "search", "trial"} <= set(schema["properties"])


def test_rollback_without_history_exits_1(tmp_path, capsys):
    recipe_path = write_recipe(tmp_path)
    assert cli.main(["rollback", str(recipe_path)]) == 1
    assert "nothing to roll back to" in capsys.readouterr().err


NOISY_MODEL = """
import os
from lightning_recompute.reference import ReferenceGPT

print("noisy: imported")


class Noisy(ReferenceGPT):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        print("noisy: built")

    def training_step(self, batch, batch_idx):
        print("noisy: step")
        os.write(1, b"noisy: native write\\n")  # as native code would, past sys.stdout
        return super().training_step(batch, batch_idx)
"""


@pytest.mark.parametrize("command", ["plan", "history"])
def test_json_output_is_the_only_thing_on_stdout(tmp_path, capfd, command):
    # A user module printing at import (and, for plan, in its steps) used to come before the JSON.
    module = f"noisy_{command}_{tmp_path.name}"  # a fresh module name: its import prints again
    (tmp_path / f"{module}.py").write_text(NOISY_MODEL, encoding="utf-8")
    recipe_path = write_recipe(tmp_path, model={"class_path": f"{module}.Noisy"})
    assert cli.main([command, str(recipe_path), "--format", "json"]) == 0
    out, err = capfd.readouterr()
    assert isinstance(json.loads(out), dict), out
    assert "noisy: imported" in err
    if command == "plan":
        assert "noisy: built" in err and "noisy: step" in err and "noisy: native write" in err


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_and_the_next_run_resumes(tmp_path):
    recipe_path = write_recipe(tmp_path, search={"n_trials": 3, "seed": 0})
    proc = subprocess.Popen(
        command(str(recipe_path), "--no-plan"),
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Readers on threads: a silent child must fail the test at the deadline, not block it forever.
        stdout, stderr = Drain(proc.stdout), Drain(proc.stderr)
        assert stdout.wait_for_line("[1/3]", timeout_s=300), f"no trial line; stderr: {stderr.text()[-3000:]}"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
        err = stderr.finish(timeout_s=60)
        stdout.finish(timeout_s=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "rerun" in err or "resume" in err

    study = open_study(recipe_path)
    first = [r for r in study.records() if r.ran]
    assert 1 <= len(first) <= 2  # the trial in flight at Ctrl-C is finished and kept
    assert not study.running()
    _, _, runs = mlflow_runs(recipe_path)
    assert not [r for r in runs if r.info.status == "RUNNING"]
    assert [r.info.status for r in runs if r.data.tags.get("recompute.kind") == "session"] == ["KILLED"]
    waiting = len(study.waiting())

    again = run_cli(tmp_path, str(recipe_path), "--search-only", "--verbose")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(--search-only: not gated, nothing written)" in again.stdout
    assert "trials, one run each" in again.stdout  # --verbose: the trials table
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path / 'mlflow.db'}" in again.stdout
    study = open_study(recipe_path)
    records = study.records()
    measured = [r for r in records if r.ran]
    assert len(measured) == 3
    assert len({(r.fingerprint, r.micro_batch) for r in measured}) == 3  # nothing measured twice
    seeds = [r.label for r in records if r.label]
    assert len(seeds) == len(set(seeds))  # no baseline enqueued or run twice
    assert len(study.waiting()) == waiting - (3 - len(first))  # the rest came from the original queue
    _, _, runs = mlflow_runs(recipe_path)
    assert not [r for r in runs if r.info.status == "RUNNING"]
    trial_numbers = [int(r.data.params["trial_number"]) for r in runs if r.data.tags.get("recompute.kind") == "trial"]
    assert sorted(trial_numbers) == [r.number for r in records]


@pytest.mark.slow
def test_two_workers_share_one_study_without_measuring_a_policy_twice(tmp_path):
    recipe_path = write_recipe(tmp_path, study={"storage": "optuna.log"}, search={"n_trials": 3, "seed": 0})
    procs = [
        subprocess.Popen(
            command(str(recipe_path), "--search-only", "--no-plan"),
            cwd=tmp_path,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=800) for p in procs]
    for p, (_out, err) in zip(procs, outputs, strict=False):
        assert p.returncode == 0, err[-3000:]

    study = open_study(recipe_path)
    records = study.records()
    measured = [r for r in records if r.ran]
    assert 3 <= len(measured) <= 4  # a worker may start one trial while the other finishes the last
    keys = [(r.fingerprint, r.micro_batch) for r in measured]
    assert len(keys) == len(set(keys)), "a policy was measured twice"
    # Seeded once: each seed is enqueued once, plus once more each time a worker stood down from it
    # (`tell_interrupted` puts a seed back in the queue; a worker may stand down when both ask at once).
    copies = Counter(t.user_attrs["seed"] for t in study.study.trials if t.user_attrs.get("seed"))
    put_back = Counter(r.label for r in records if r.label and r.outcome == "interrupted")
    assert copies, "no seed was enqueued"
    assert {name: n - put_back[name] for name, n in copies.items()} == dict.fromkeys(copies, 1), (
        "the study was seeded twice"
    )
    assert not study.running()
    assert (
        len({t.user_attrs.get("worker") for t in study.study.trials if t.state != optuna.trial.TrialState.WAITING}) == 2
    )

    _, _, runs = mlflow_runs(recipe_path)
    trial_numbers = [int(r.data.params["trial_number"]) for r in runs if r.data.tags.get("recompute.kind") == "trial"]
    assert sorted(trial_numbers) == [r.number for r in records]  # every trial logged, once
    assert not [r for r in runs if r.info.status == "RUNNING"]


@pytest.mark.slow
def test_a_co_tuned_micro_batch_is_written_into_the_policy_file_and_printed(tmp_path, capsys):
    recipe_path = write_recipe(
        tmp_path,
        data={"init_args": {"batch_size": 8, "num_batches": 8}},
        search={"n_trials": 3, "seed": 0, "micro_batch_sizes": [4, 8, 16]},
    )
    proc = run_cli(tmp_path, str(recipe_path), "--format", "json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["status"] == "promoted"
    best_mb = summary["best"]["micro_batch"]
    assert best_mb in (4, 8, 16)

    # The file says what it was tuned for: the winner's micro-batch, the data's batch, the figures.
    tuned = RecomputePolicy.load(tmp_path / "policy.yaml").tuned_for
    assert tuned is not None
    assert (tuned.micro_batch, tuned.data_batch_size, tuned.device) == (best_mb, 8, "cpu")
    assert tuned.peak_bytes is not None and tuned.limit_bytes == summary["budget_bytes"]
    assert tuned.peak_bytes <= tuned.limit_bytes
    assert summary["tuned_for"] == tuned.to_dict()
    expected = {4: "set batch_size=4, accumulate_grad_batches=2", 8: "no change", 16: "set batch_size=16"}[best_mb]
    assert summary["training_change"].startswith(expected)

    # history shows the micro-batch of the decision; the text report of `history` too.
    assert cli.main(["history", str(recipe_path), "--format", "json"]) == 0
    decisions = json.loads(capsys.readouterr().out)["decisions"]
    assert [(d["kind"], d["micro_batch"]) for d in decisions] == [("promote", best_mb)]
    assert cli.main(["history", str(recipe_path)]) == 0
    assert f"mb {best_mb:<4}" in capsys.readouterr().out

    # The text report, from a second run (the study is finished, so it only re-reads the decision).
    again = run_cli(tmp_path, str(recipe_path))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"unchanged: {summary['best']['policy_short']} at micro-batch {best_mb} " in again.stdout
    assert f"in the training job: {expected}" in again.stdout


@pytest.mark.parametrize("command", ["history", "rollback"])
def test_read_only_commands_never_create_an_experiment(tmp_path, uri, capsys, command):
    # A misspelt tracking.experiment used to be created, empty, by history and rollback.
    MlflowClient(uri).create_experiment("tiny-real")
    recipe_path = write_recipe(tmp_path, tracking={"uri": uri, "experiment": "tiny-reel"})
    assert cli.main([command, str(recipe_path)]) == 2
    err = capsys.readouterr().err
    assert "tracking.experiment: 'tiny-reel' is not an experiment in" in err and "'tiny-real'" in err, err
    assert MlflowClient(uri).get_experiment_by_name("tiny-reel") is None


@pytest.mark.slow
def test_a_rollback_killed_mid_decision_is_cleaned_up_by_the_next(tmp_path, capsys):
    # A rollback SIGKILLed before its file replace left its decision run RUNNING and its
    # .policy.yaml.*.tmp for good, through later rollbacks and tunes.
    import os
    import time

    recipe_path = write_recipe(tmp_path)
    recipe = load(recipe_path)
    from tuner._tracking import Tracker

    tracker = Tracker(recipe.tracking.uri, str(recipe.tracking.experiment))
    first = RecomputePolicy.uniform("full")
    tracker.registry.promote(first, source_run_id=None, output_path=recipe.output, reason="first", evidence={})
    tracker.registry.promote(
        RecomputePolicy.uniform("selective"),
        source_run_id=None,
        output_path=recipe.output,
        reason="second",
        evidence={},
    )
    killed = subprocess.run(
        command("rollback", str(recipe_path)),
        cwd=tmp_path,
        env=child_env(RECOMPUTE_TUNE_TEST_KILL_AT="rollback"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    client, _, runs = mlflow_runs(recipe_path)
    (dead,) = [r for r in runs if r.info.status == "RUNNING"]
    assert dead.data.tags["recompute.decision"] == "rollback"
    # What a kill inside the atomic write leaves (the kill point is just before it), an hour old;
    # and a fresh one, as another worker's write in progress would be.
    stale, fresh = tmp_path / ".policy.yaml.k1ll3d.tmp", tmp_path / ".policy.yaml.wr1t1ng.tmp"
    stale.write_text("half a policy")
    fresh.write_text("a write in progress")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))

    assert cli.main(["rollback", str(recipe_path)]) == 0
    out = capsys.readouterr().out
    assert f"cleaned up: decision run {dead.info.run_id} of a dead process ended KILLED" in out
    assert f"cleaned up: removed {stale}: a temporary file of a killed write" in out
    assert not stale.exists() and fresh.exists()
    assert client.get_run(dead.info.run_id).info.status == "KILLED"
    _, _, runs = mlflow_runs(recipe_path)
    assert not [r for r in runs if r.info.status == "RUNNING"]
    assert [d.kind for d in tracker.registry.history()] == ["promote", "promote", "rollback"]
    assert RecomputePolicy.load(recipe.output) == first


def _damaged_sqlite(path: Path) -> None:
    path.write_bytes(b"SQLite format 3\x00" + b"\x00" * 84)  # a header, then nothing: as a cut copy leaves it


def _cut_journal(path: Path) -> None:
    from optuna.storages.journal import JournalFileBackend

    storage = optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    study = optuna.create_study(storage=storage, study_name="earlier")
    for _ in range(2):
        study.tell(study.ask(), 1.0)
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size - 7)


@pytest.mark.parametrize(
    ("command", "damage", "key", "expected"),
    [
        ("tune", "optuna.db", "study.storage", "failed: DatabaseError: file is not a database."),
        ("history", "mlflow.db", "tracking.uri", "failed: DatabaseError: file is not a database."),
        ("tune", "optuna.log", "study.storage", "its last record was probably cut short"),
    ],
    ids=["damaged-optuna-db", "damaged-mlflow-db", "cut-journal"],
)
def test_a_damaged_store_is_one_clear_message_exit_3_and_json(tmp_path, capsys, fakes, command, damage, key, expected):
    # Each used to be a traceback of 43-230 lines, exit 1 (nothing promoted), nothing on stdout.
    study = {"storage": "optuna.log"} if damage.endswith(".log") else {}
    recipe_path = write_recipe(tmp_path, study=study) if study else write_recipe(tmp_path)
    (_cut_journal if damage.endswith(".log") else _damaged_sqlite)(tmp_path / damage)
    before = (tmp_path / damage).read_bytes()
    args = [command, str(recipe_path), "--format", "json"] + (["--no-plan"] if command == "tune" else [])
    assert cli.main(args) == 3
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert (summary["status"], summary["exit_code"]) == ("store failed", 3)
    assert summary["error"].startswith(f"{key}: ") and expected in summary["error"], summary["error"]
    assert str(tmp_path / damage) in summary["error"]
    assert "Traceback" not in err and err.count("\n") <= 4, err
    if damage != "optuna.log":  # the journal's tail is appended to by Optuna itself before it fails
        assert (tmp_path / damage).read_bytes() == before  # nothing stored is removed
    assert not (tmp_path / "policy.yaml").exists()


def test_a_tracking_uri_that_is_not_mlflow_is_one_clear_message(tmp_path, capsys):
    import http.server
    import threading

    class NotMlflow(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b"<html>a web site, not MLflow</html>")

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotMlflow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://127.0.0.1:{server.server_address[1]}"
        recipe_path = write_recipe(tmp_path, tracking={"uri": uri, "experiment": "x"})
        assert cli.main(["history", str(recipe_path)]) == 3
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert err.startswith(f"error: tracking.uri: the MLflow tracking store {uri} failed: "), err
    assert "check that tracking.uri is an MLflow tracking server" in err and "Traceback" not in err


def test_a_full_disk_while_promoting_is_exit_3_and_nothing_is_promoted(tmp_path, capsys, fakes, monkeypatch):
    import errno

    recipe_path = write_recipe(tmp_path)

    def no_space(self, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(RecomputePolicy, "save", no_space)
    assert cli.main([str(recipe_path), "--no-plan", "--format", "json"]) == 3
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert summary["error"].startswith(
        f"output: cannot write {tmp_path / 'policy.yaml'} (No space left on device). Nothing was promoted"
    ), summary["error"]
    assert "Traceback" not in err
    monkeypatch.undo()
    assert not (tmp_path / "policy.yaml").exists()
    _, _, runs = mlflow_runs(recipe_path)
    assert not [r for r in runs if r.info.status == "RUNNING"]
    assert not [r for r in runs if r.data.tags.get("recompute.decision") and r.info.status == "FINISHED"]
