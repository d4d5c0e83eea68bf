"""A recipe's settings are checked before anything is measured: output path, tracking URI, study storage.

Each bad setting used to let a whole session run, then fail with a traceback and exit 1 when the
result was written. The CLI tests assert that nothing was profiled or stored: no study database,
no tracking database, no profiling line.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_env
from tests.tuner.cli_run import TINY, run_cli, write_recipe
from tuner import _preflight as preflight
from tuner import cli
from tuner._preflight import output_problem, storage_problem, tracking_problem


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------- the checks


def test_an_output_path_whose_parent_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    problem = output_problem(tmp_path / "afile" / "sub" / "policy.yaml")
    assert problem is not None and problem.startswith("output:") and "is a file" in problem


def test_an_output_path_that_is_a_directory(tmp_path: Path) -> None:
    problem = output_problem(tmp_path)
    assert problem is not None and "is a directory" in problem and "policy.yaml" in problem


@pytest.mark.parametrize("path", ["/proc/policy.yaml", "/proc/self/policy.yaml", "/sys/policy.yaml"])
def test_an_output_path_on_a_kernel_filesystem(path: str) -> None:
    problem = output_problem(Path(path))
    assert problem is not None and "kernel filesystem" in problem


def test_an_output_folder_that_refuses_a_file(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        probe = locked / "probe"
        try:
            probe.write_text("x")
        except PermissionError:
            pass
        else:  # root ignores permission bits; nothing here can make the folder refuse root
            probe.unlink()
            pytest.skip("running as root: a read-only folder still accepts files")
        problem = output_problem(locked / "policy.yaml")
        assert problem is not None and "cannot create a file" in problem
        problem = output_problem(locked / "new" / "policy.yaml")  # a missing folder would be made there
        assert problem is not None and "cannot create a file" in problem
    finally:
        locked.chmod(0o700)
    assert list(locked.iterdir()) == []  # the probe file was removed


def test_a_writable_output_path_passes_and_leaves_nothing_behind(tmp_path: Path) -> None:
    assert output_problem(tmp_path / "not" / "yet" / "policy.yaml") is None
    assert output_problem(tmp_path / "policy.yaml") is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("uri", ["garbage://x/y", "not a uri", "/an/absolute/path", "sqlite3:///x.db"])
def test_tracking_uris_mlflow_cannot_open(uri: str) -> None:
    problem = tracking_problem(uri)
    assert problem is not None and problem.startswith("tracking.uri:") and "sqlite:///" in problem, problem


def test_tracking_uris_mlflow_opens(tmp_path: Path) -> None:
    assert tracking_problem(f"sqlite:///{tmp_path / 'mlflow.db'}") is None
    assert tracking_problem("postgresql://user:secret@db.invalid/mlflow") is None  # not connected: MLflow's to open
    assert list(tmp_path.iterdir()) == []  # checking opens nothing


def test_an_unreachable_tracking_server_is_named() -> None:
    port = closed_port()
    problem = tracking_problem(f"http://127.0.0.1:{port}/")
    assert problem is not None and f"127.0.0.1:{port}" in problem and "mlflow server" in problem


@pytest.mark.parametrize("url", ["garbage://x", "optuna.db", "sqlite:/x.db"])
def test_study_storages_optuna_cannot_open(url: str) -> None:
    problem = storage_problem(url)
    assert problem is not None and problem.startswith("study.storage:") and ".log" in problem, problem


def test_study_storages_optuna_opens(tmp_path: Path) -> None:
    assert storage_problem(f"sqlite:///{tmp_path / 'optuna.db'}") is None
    assert storage_problem(str(tmp_path / "journal.log")) is None
    assert list(tmp_path.iterdir()) == []


def test_a_missing_driver_names_the_extra_and_hides_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy.engine import make_url

    dialect = make_url("postgresql://u:pw@h/db").get_dialect()

    def no_driver() -> None:
        raise ImportError("no module named psycopg")

    monkeypatch.setattr(dialect, "import_dbapi", no_driver)
    problem = storage_problem("postgresql://u:hunter2@db.example/study")
    assert problem is not None and "lightning-recompute[postgres]" in problem
    assert "hunter2" not in problem and "db.example" in problem


def test_problems_are_reported_together(tmp_path: Path) -> None:
    from tuner.recipe import load

    (tmp_path / "afile").write_text("x")
    recipe = load(
        write_recipe(
            tmp_path,
            output="afile/policy.yaml",
            tracking={"uri": "garbage://x"},
            study={"storage": "garbage://x"},
        )
    )
    with pytest.raises(preflight.SettingsError) as info:
        preflight.check_settings(recipe)
    keys = [p.split(":", 1)[0] for p in info.value.problems]
    assert keys == ["output", "tracking.uri", "study.storage"], info.value.problems


# ---------------------------------------------------------------------------------------------- the CLI


def run_here(
    folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str, str]:
    """``recompute-tune ARGS`` in this process, from ``folder``: exit code, stdout, stderr. A refusal before
    anything is profiled starts no process (the fast tier's guard would fail the test if it did)."""
    monkeypatch.chdir(folder)
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_tune_refuses_bad_settings_before_profiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "afile").write_text("x")
    write_recipe(
        tmp_path,
        output="afile/policy.yaml",
        tracking={"uri": "garbage://x"},
        study={"storage": "garbage://x"},
    )
    code, out, err = run_here(tmp_path, monkeypatch, capsys, "tiny.yaml")
    assert code == 2, err[-3000:]
    for key in ("output:", "tracking.uri:", "study.storage:"):
        assert key in err, err[-3000:]
    assert "profiling" not in out + err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "tiny.yaml"]  # no database, no policy


@pytest.mark.slow
def test_an_unreachable_tracking_server_fails_clearly(tmp_path: Path) -> None:
    port = closed_port()
    write_recipe(tmp_path, tracking={"uri": f"http://127.0.0.1:{port}/"})
    proc = run_cli(tmp_path, "tiny.yaml", timeout=300)  # a deadline: it used to retry for 20 minutes
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"tracking.uri: cannot reach the tracking server at 127.0.0.1:{port}" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "optuna.db").exists()


@pytest.mark.slow
def test_the_tuner_bounds_mlflow_http_retries_unless_the_user_set_them(tmp_path: Path) -> None:
    script = (
        "import json, os\n"
        "from tuner._stores import bound_tracking_requests\n"
        "bound_tracking_requests()\n"
        "from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES as R, "
        "MLFLOW_HTTP_REQUEST_TIMEOUT as T, MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT as S\n"
        "print(json.dumps([R.get(), T.get(), S.get()]))\n"
    )
    e = child_env()
    for name in preflight_env_names():
        e.pop(name, None)
    e["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "77"  # the user's own value wins
    out = subprocess.run(
        [sys.executable, "-c", script], check=True, cwd=tmp_path, env=e, capture_output=True, text=True, timeout=120
    )
    assert json.loads(out.stdout.splitlines()[-1]) == [3, 77, True]


def preflight_env_names() -> list[str]:
    from tuner._stores import TRACKING_REQUEST_DEFAULTS

    return list(TRACKING_REQUEST_DEFAULTS)


def test_plan_refuses_an_unwritable_write_path_and_rejected_init_args(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "afile").write_text("x")
    write_recipe(tmp_path)
    code, _, err = run_here(tmp_path, monkeypatch, capsys, "plan", "tiny.yaml", "--write", "afile/plan.yaml")
    assert code == 2, err[-3000:]
    assert "--write:" in err and "is a file" in err, err[-3000:]

    model = {"init_args": {**TINY["model"]["init_args"], "n_embd": 30, "n_head": 4}}  # type: ignore[index]
    write_recipe(tmp_path, model=model)
    code, _, err = run_here(tmp_path, monkeypatch, capsys, "plan", "tiny.yaml")
    assert code == 2, err[-3000:]
    assert "model.init_args:" in err and "n_head=4" in err, err[-3000:]


def test_read_only_commands_create_no_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write_recipe(tmp_path)
    code, out, err = run_here(tmp_path, monkeypatch, capsys, "history", "tiny.yaml", "--format", "json")
    assert code == 0, err[-3000:]
    history = json.loads(out)
    assert history["decisions"] == [] and history["missing"] == str(tmp_path / "mlflow.db")
    code, _, err = run_here(tmp_path, monkeypatch, capsys, "rollback", "tiny.yaml")
    assert code == 1 and "no tracking database" in err, err[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.yaml"]
