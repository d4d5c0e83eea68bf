"""Dead owners: a SIGKILLed tuning session's trial, setup, session run, worker and temp folder.

The fast tests kill a real child process that runs a tuning session (with the deterministic fake
trials of `test_session.py`), then run the next session here. The slow fault-injection test
SIGKILLs the real ``recompute-tune`` at each of five points in turn (``RECOMPUTE_TUNE_TEST_KILL_AT``,
see `tuner._liveness`), each run recovering from the one before, and reruns it to completion.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from lightning_recompute.policy import RecomputePolicy
from tests.helpers import REPO, child_env
from tests.tuner.cli_run import TINY as CLI_TINY
from tests.tuner.fakes import make_recipe, runs, study_of
from tuner import _liveness as liveness
from tuner import session
from tuner._liveness import Owner, dead_reason
from tuner._search import TuningStudy
from tuner._search.attrs import StudyAttr, TrialAttr
from tuner._search.lease import lease_name
from tuner._trials.forkserver import SERVER_PARENT_ENV, forking
from tuner._trials.runner import TRIAL_DIR_ENV, clean_stale_trial_dirs

DEADLINE_S = 300

# A child process running one tuning session with the fake trials, killing itself as told.
CHILD = """
import os, signal, sys
from pathlib import Path
from tests.tuner.fakes import ExactTrials, make_recipe
from tuner import session
import tuner._trials

folder, uri, kill_on_call = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
os.chdir(folder)
fakes = ExactTrials(on_call=lambda n, policy: os.kill(os.getpid(), signal.SIGKILL) if n == kill_on_call else None)
tuner._trials.run_trial = fakes.run_trial
tuner._trials.check_numerics = fakes.check_numerics
session.tune(make_recipe(folder, uri, n_trials=4), use_planner=False)
"""


def run_child(folder: Path, uri: str, kill_on_call: int, **env: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder), uri, str(kill_on_call)],
        cwd=REPO,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, f"the child was not killed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc


def dead_pid() -> int:
    """The pid of a process that has just exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


# ---------------------------------------------------------------------------------------------- owners


@pytest.mark.slow
def test_an_owner_on_this_host_is_dead_once_its_pid_is_gone_and_elsewhere_after_the_grace_period():
    me = Owner.me()
    assert dead_reason(me, None, grace=1.0, since=0.0) is None  # alive here, however old
    gone = Owner(socket.gethostname(), dead_pid(), None)
    assert "is gone" in (dead_reason(gone, time.time(), grace=3600.0) or "")
    recycled = Owner(me.host, me.pid, "not-my-start-time")
    assert "another process" in (dead_reason(recycled, time.time(), grace=3600.0) or "")
    far = Owner("another-host.example", 1, "1")
    assert dead_reason(far, time.time() - 10, grace=60.0) is None
    assert "no heartbeat" in (dead_reason(far, time.time() - 120, grace=60.0) or "")
    assert dead_reason(None, None, grace=60.0, since=time.time() - 120) is not None  # an older version's


def test_the_grace_period_and_heartbeat_come_from_the_environment_and_bad_values_are_refused(monkeypatch):
    monkeypatch.setenv("RECOMPUTE_TUNE_GRACE_S", "7.5")
    assert liveness.grace_s() == 7.5
    monkeypatch.setenv("RECOMPUTE_TUNE_HEARTBEAT_S", "-1")
    with pytest.raises(ValueError, match="RECOMPUTE_TUNE_HEARTBEAT_S"):
        liveness.heartbeat_s()


# ---------------------------------------------------------------------------------------------- a dead session


@pytest.mark.slow
def test_a_session_killed_mid_trial_is_failed_recorded_and_its_candidate_measured_by_the_next(
    tmp_path, tracking_uri, fakes
):
    run_child(tmp_path, tracking_uri, kill_on_call=2)
    recipe = make_recipe(tmp_path, tracking_uri, n_trials=4)
    (stuck,) = [r for r in runs(recipe, "session") if r.info.status == "RUNNING"]

    summary = session.tune(recipe, use_planner=False, search_only=True)
    study = study_of(recipe, summary)
    assert not study.running()
    dead = [r for r in summary.records if r.outcome == "abandoned"]
    assert len(dead) == 1 and dead[0].state == "FAIL" and "is gone" in (dead[0].reason or "")
    # The candidate came back and was measured once; every baseline was measured exactly once.
    measured = Counter(r.label for r in summary.records if r.ran)
    assert measured == Counter({f"baseline:{b}": 1 for b in ("none", "full", "selective", "every_2nd_full")})
    assert dead[0].label in measured
    assert summary.baselines[dead[0].label.split(":")[1]].outcome == "ok"  # type: ignore[union-attr]

    # MLflow: the dead trial is a FAILED run of the dead session, which ended KILLED; nothing RUNNING.
    all_runs = runs(recipe)
    assert not [r for r in all_runs if r.info.status == "RUNNING"]
    (record,) = [r for r in runs(recipe, "trial") if r.data.params.get("trial_number") == str(dead[0].number)]
    assert record.info.status == "FAILED" and record.data.tags["recompute.outcome"] == "abandoned"
    assert "owner died" in record.data.tags["recompute.reason"]
    assert record.data.tags["mlflow.parentRunId"] == stuck.info.run_id
    ended = next(r for r in all_runs if r.info.run_id == stuck.info.run_id)
    assert ended.info.status in ("KILLED", "FINISHED")  # ended KILLED, then resumed by this session
    assert "owner died" in ended.data.tags["recompute.session_ended_by"]
    # The totals add up: every trial the study handed out is one MLflow trial run.
    asked = [t for t in study.study.get_trials(deepcopy=False) if t.state != TrialState.WAITING]
    logged = Counter(r.data.params["trial_number"] for r in runs(recipe, "trial"))
    assert sorted(logged) == sorted(str(t.number) for t in asked) and set(logged.values()) == {1}


@pytest.mark.slow
def test_a_setup_whose_owner_died_is_taken_over_at_once(tmp_path, tracking_uri, fakes, monkeypatch):
    run_child(tmp_path, tracking_uri, kill_on_call=0, RECOMPUTE_TUNE_TEST_KILL_AT="profiling")
    recipe = make_recipe(tmp_path, tracking_uri, n_trials=4)
    # Waiting for a dead worker would hang this test past its deadline: the wait must not happen.
    monkeypatch.setattr(session, "SETUP_WAIT_S", 10 * DEADLINE_S)
    notes: list[str] = []
    summary = session.tune(recipe, use_planner=False, search_only=True, on_note=notes.append)
    assert any("taking over the study's setup: owner died" in n for n in notes), notes
    assert sum(1 for r in summary.records if r.ran) == 4


def test_a_worker_waiting_on_a_live_setup_owner_keeps_waiting_and_ctrl_c_marks_nothing(tmp_path, tracking_uri):
    recipe = make_recipe(tmp_path, tracking_uri)
    from tuner._search import SearchSpace, inspect_layers

    space = SearchSpace.for_layers(inspect_layers(recipe), recipe.search.modes)
    creator = TuningStudy.open(name="s", storage=str(recipe.study.storage), space=space, budget_bytes=1)
    joiner = TuningStudy.open(name="s", storage=str(recipe.study.storage), space=space, budget_bytes=1)
    assert creator.created and not joiner.created
    # The creator (this process) lives: the joiner waits out its timeout, not less.
    assert joiner.wait_or_take_setup(0.2, 60.0, poll_s=0.05) == "the worker setting it up took longer than 0.2 s"
    attrs = joiner.study.user_attrs
    assert not attrs.get(StudyAttr.ABANDONED) and not attrs.get(StudyAttr.SEEDED)


def test_a_setup_given_up_is_taken_over_once_and_a_later_worker_waits_for_the_new_owner(tmp_path, tracking_uri):
    recipe = make_recipe(tmp_path, tracking_uri)
    from tuner._search import SearchSpace, inspect_layers

    space = SearchSpace.for_layers(inspect_layers(recipe), recipe.search.modes)
    creator, second, third = (
        TuningStudy.open(name="s", storage=str(recipe.study.storage), space=space, budget_bytes=1) for _ in range(3)
    )
    creator.abandon_setup()
    assert second.wait_or_take_setup(60.0, 60.0, poll_s=0.05) == "the worker setting it up gave up"
    # The second worker (alive, this process) owns the setup now: the third waits for it, not takes it over too.
    assert third.wait_or_take_setup(0.2, 60.0, poll_s=0.05) == "the worker setting it up took longer than 0.2 s"


def test_a_trial_of_a_silent_owner_on_another_host_is_reaped_after_the_grace_period(tmp_path, tracking_uri):
    recipe = make_recipe(tmp_path, tracking_uri)
    from tuner._search import SearchSpace, inspect_layers

    space = SearchSpace.for_layers(inspect_layers(recipe), recipe.search.modes)
    study = TuningStudy.open(name="s", storage=str(recipe.study.storage), space=space, budget_bytes=1)
    proposal = study.ask()
    trial = proposal.trial
    trial.set_user_attr(TrialAttr.OWNER, Owner("another-host.example", 4242, "1").to_dict())
    trial.set_user_attr(TrialAttr.HEARTBEAT, time.time() - 30)
    assert study.reap_dead(60.0) == [] and study.running_alive(60.0) == 1
    ((dead, why),) = study.reap_dead(10.0)
    assert dead.number == trial.number and "no heartbeat" in why
    assert not study.running() and study.reap_dead(10.0) == []  # reaped once
    (again,) = study.waiting()
    assert again.system_attrs["fixed_params"] == trial.params and again.user_attrs[TrialAttr.RETRY_OF] == trial.number
    retry = study.ask()
    assert retry.duplicate_of is None  # the dead trial is no evidence: the candidate is measured


# ---------------------------------------------------------------------------------------------- workers, folders


@pytest.mark.slow
def test_trial_folders_of_dead_owners_are_removed_with_their_processes_and_live_ones_kept(tmp_path):
    def folder(name: str, owner: Owner | None) -> Path:
        f = tmp_path / f"recompute-trial-{name}"
        f.mkdir()
        if owner is not None:
            (f / "owner.json").write_text(json.dumps(owner.to_dict()), encoding="utf-8")
        return f

    dead = folder("dead", Owner(socket.gethostname(), dead_pid(), None))
    live = folder("live", Owner.me())
    unowned = folder("unowned", None)
    elsewhere = folder("elsewhere", Owner("another-host.example", dead_pid(), None))
    forked_dead = folder("forked-dead", Owner(socket.gethostname(), dead_pid(), None))
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    leftover = subprocess.Popen(sleep, env=child_env(**{TRIAL_DIR_ENV: str(dead)}))
    # A forked worker's /proc environment is the fork server's, without the folder: it is found by
    # the session the folder records and its server's parent, the folder's owner.
    owner = json.loads((forked_dead / "owner.json").read_text(encoding="utf-8"))["pid"]
    by_owner = child_env(**{SERVER_PARENT_ENV: str(owner)})
    forked = subprocess.Popen(sleep, env=by_owner, start_new_session=True)
    (forked_dead / "worker.json").write_text(json.dumps({"pid": forked.pid, "forked": True}), encoding="utf-8")
    # The owner's server's environment, but outside the session the folder records: another worker's.
    outsider = subprocess.Popen(sleep, env=by_owner, start_new_session=True)
    # The session a folder records, but another owner's server: a reused pid, not this folder's worker.
    reused = folder("reused", Owner(socket.gethostname(), dead_pid(), None))
    stranger = subprocess.Popen(sleep, env=child_env(**{SERVER_PARENT_ENV: "1"}), start_new_session=True)
    (reused / "worker.json").write_text(json.dumps({"pid": stranger.pid, "forked": True}), encoding="utf-8")
    try:
        assert sorted(clean_stale_trial_dirs(tmp_path)) == sorted([dead, forked_dead, reused])
        assert leftover.wait(timeout=60) == -signal.SIGKILL
        assert forked.wait(timeout=60) == -signal.SIGKILL
        assert stranger.poll() is None and outsider.poll() is None
    finally:
        for proc in (leftover, forked, outsider, stranger):
            proc.kill()
            proc.wait(timeout=60)
    assert not dead.exists() and not forked_dead.exists()
    assert live.exists() and unowned.exists() and elsewhere.exists()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_trial_worker_dies_with_its_parent(tmp_path):
    # A parent starts the worker (which then waits on stdin-less sleep via a hang spec) and is SIGKILLed.
    parent = f"""
import os, subprocess, sys, time
w = subprocess.Popen([sys.executable, "-c",
    "import os, sys; from tuner._trials.worker import die_with_parent; "
    "die_with_parent(os.environ['RECOMPUTE_TUNE_PARENT_PID']); "
    "open(sys.argv[1], 'w').write(str(os.getpid())); import time; time.sleep(600)", {str(tmp_path / "pid")!r}],
    env={{**os.environ, "RECOMPUTE_TUNE_PARENT_PID": str(os.getpid())}}, start_new_session=True)
deadline = time.monotonic() + 120
while not os.path.exists({str(tmp_path / "pid")!r}) and time.monotonic() < deadline:
    time.sleep(0.05)
os.kill(os.getpid(), 9)
"""
    proc = subprocess.run([sys.executable, "-c", parent], env=child_env(), timeout=DEADLINE_S, check=False)
    assert proc.returncode == -signal.SIGKILL
    pid = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 60
    while liveness.pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not liveness.pid_alive(pid)


# ---------------------------------------------------------------------------------------------- fault injection

# test_cli's tiny recipe (three blocks of width 32, sequence 32), with two trials and no race. Without
# a race the gate holds no speed figure against its confirmation, so whether the last run promotes
# is a matter of states (fits, numerics), not of how fast 1 ms steps come out on a loaded machine:
# with the race and forked workers, 2 of 14 pinned runs of the chain ended with the gate rejecting FFF
# on a confirmation 29-40% below the race's figure (the flake loop of docs/TESTING.md). Kills and
# resumes are what these tests are about; the race's own decisions are tested in tests/tuner/race.
TINY = {**CLI_TINY, "search": {"n_trials": 2, "seed": 0}, "race": {"enabled": False}}
SEEDS = {f"baseline:{b}" for b in ("none", "full", "selective", "every_2nd_full")}


def tune_cli(folder: Path, tmpdir: Path, kill_at: str | None) -> subprocess.CompletedProcess[str]:
    env = child_env(TMPDIR=str(tmpdir))
    env.pop("RECOMPUTE_TUNE_TEST_KILL_AT", None)
    if kill_at is not None:
        env["RECOMPUTE_TUNE_TEST_KILL_AT"] = kill_at
    return subprocess.run(
        [sys.executable, "-m", "tuner", "tiny.yaml", "--no-plan"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=2 * DEADLINE_S,  # a whole session, gate included, on a loaded machine
        check=False,
        start_new_session=True,  # its own process group, as a shell job: the kill takes the group
    )


def trial_processes(tmpdir: Path) -> list[int]:
    """Workers (fresh or forked) of the trial folders in ``tmpdir``, and their owners' fork servers, still running."""
    from tuner._trials.forkserver import SERVER_PARENT_ENV
    from tuner._trials.runner import _pids_with_env, trial_processes

    found = set()
    for folder in tmpdir.glob("recompute-trial-*"):
        found.update(trial_processes(folder))
        owner = json.loads((folder / "owner.json").read_text(encoding="utf-8"))["pid"]
        found.update(_pids_with_env(SERVER_PARENT_ENV, str(owner)))
    return sorted(found)


# The points in the order one session reaches them: with n_trials=2, each rerun of the study gets
# one point further than the run it recovers from (setup, a trial, the next trial, the gate, the
# promotion), so one study killed at each in turn exercises all five, each recovered from by a real
# run; one study rather than five saves four whole sessions of subprocesses.
CHAIN = ("profiling", "trial", "between", "gate", "after_write")


def study_trials(folder: Path, *, lease_allowed: bool = True) -> list[optuna.trial.FrozenTrial]:
    """The trials of the one study in the folder's storage (a session killed in the gate leaves its
    gate lease study behind, which the next run breaks: ``lease_allowed`` says whether it may be there)."""
    from tuner._stores import open_storage
    from tuner.recipe import load

    storage = open_storage(str(load(folder / "tiny.yaml").study.storage))
    names = optuna.get_all_study_names(storage)
    studies = [n for n in names if not any(n == lease_name(m) for m in names)]
    assert len(studies) == 1 and (lease_allowed or names == studies), names
    return optuna.load_study(study_name=studies[0], storage=storage).get_trials(deepcopy=False)


@pytest.mark.slow
def test_kill_9_at_each_point_in_turn_then_rerun_leaves_nothing_running_and_loses_no_candidate(tmp_path):
    from tuner._liveness import POINTS

    # `rollback` is not a session's point: test_cli.py kills a rollback there.
    assert set(CHAIN) == set(POINTS) - {"rollback"}, "a new kill point needs its place in the chain"
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY), encoding="utf-8")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    for point in CHAIN:
        killed = tune_cli(tmp_path, tmpdir, point)
        assert killed.returncode == -signal.SIGKILL, f"{point}: {killed.returncode}\n{killed.stderr[-3000:]}"
        trials = study_trials(tmp_path)
        if point == "profiling":
            assert not trials  # killed while setting the study up: nothing seeded yet
        elif point == "trial":
            # This run took the dead run's setup over at once, then died mid-trial.
            assert "taking over the study's setup: owner died" in killed.stderr, killed.stderr[-3000:]
            # The worker followed its parent: the fork server (the default; it follows the tuning
            # process) or, with RECOMPUTE_TUNE_FORK_SERVER=0 in the caller's environment, the tuning
            # process itself. No trial process outlives the kill.
            folders = list(tmpdir.glob("recompute-trial-*"))
            forked = [json.loads((f / "worker.json").read_text())["forked"] for f in folders]
            assert forked == [forking(os.environ)]
            deadline = time.monotonic() + 60
            while trial_processes(tmpdir) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not trial_processes(tmpdir)
            assert list(tmpdir.glob("recompute-trial-*"))  # the folder stays until the next run
            assert [t.state for t in trials if t.state != TrialState.WAITING] == [TrialState.RUNNING]
        else:
            # The run after each kill reaped what it left: no trial RUNNING, no dead owner's folder.
            assert not [t for t in trials if t.state == TrialState.RUNNING], point
            assert not list(tmpdir.glob("recompute-trial-*")), point
            outcomes = [t.user_attrs.get("outcome") for t in trials if t.state != TrialState.WAITING]
            assert "abandoned" in outcomes, (point, outcomes)  # the trial killed mid-run, failed
            if point == "after_write":
                # The file is written, the promotion not recorded: the next run must reconcile them.
                assert (tmp_path / "policy.yaml").exists()
    done = tune_cli(tmp_path, tmpdir, None)
    assert done.returncode == 0, f"after the chain:\n{done.stderr[-3000:]}"
    check_consistent(tmp_path, "the chain")
    assert not list(tmpdir.glob("recompute-trial-*"))


def check_consistent(folder: Path, point: str) -> None:
    trials = study_trials(folder, lease_allowed=False)
    assert not [t for t in trials if t.state == TrialState.RUNNING], point
    measured = [t for t in trials if t.user_attrs.get("outcome") in ("ok", "over_budget", "oom", "timeout", "error")]
    keys = Counter(t.user_attrs["candidate_key"] for t in measured)
    assert set(keys.values()) == {1}, f"{point}: measured twice: {keys}"
    assert len(measured) == TINY["search"]["n_trials"], point  # type: ignore[index]
    # No lost candidate: every seed is measured exactly once or still queued (a retried one goes
    # back at the end of the queue), never both, never twice.
    seeds = Counter(t.user_attrs.get("seed") for t in measured if t.user_attrs.get("seed"))
    queued = Counter(t.user_attrs.get("seed") for t in trials if t.state == TrialState.WAITING)
    assert set(seeds.values()) <= {1} and set(queued.values()) <= {1}, point
    assert not set(seeds) & set(queued) and set(seeds) | set(queued) == SEEDS, (point, seeds, queued)

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    (exp,) = [e for e in client.search_experiments() if e.name != "Default"]
    all_runs = client.search_runs([exp.experiment_id], max_results=1000)
    assert not [r for r in all_runs if r.info.status == "RUNNING"], point
    good = exp.tags["recompute.good_run_id"]
    good_run = client.get_run(good)
    on_disk = RecomputePolicy.load(folder / "policy.yaml").fingerprint()
    assert on_disk == good_run.data.params["policy_fingerprint"], point
