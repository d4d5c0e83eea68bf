"""The GPU acceptance checks' device, and their figures written as JSON (``--gpu-json PATH``).

Each check runs on CUDA when there is one, else as the CPU dry run: tiny sizes and the rules of the
paths a CPU has, so the code a GPU session runs has run before a GPU is lent. Each check records what
it measured in its ``figures``; with ``--gpu-json PATH`` (registered in tests/conftest.py) the file
is written after every check, so a run cut short keeps what it measured, with each check's outcome.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Generator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu.common import CPU_SIZES, CUDA_SIZES, Device, environment
from tuner._trials.oom import is_oom_error

CHECK_ORDER = ("meter", "numerics", "offload", "session", "planner", "compile", "in_job")
"""The order the checks run in, each its own file (``test_meter.py``)."""
_HERE = Path(__file__).resolve().parent
_RESULTS = pytest.StashKey[dict[str, dict[str, Any]]]()
_EXPECTED = pytest.StashKey[list[str]]()
_STARTED = pytest.StashKey[float]()


def pytest_report_header(config: pytest.Config) -> str:
    """Versions first: what a reader of a run cut short needs (shown when tests/gpu is named on the command line)."""
    return "gpu acceptance: " + ", ".join(f"{k} {v}" for k, v in environment().items())


@pytest.fixture(scope="session")
def device() -> Iterator[Device]:
    """CUDA when there is one, with its sizes; else the CPU and the dry run's tiny sizes."""
    child_env = dict(os.environ)  # a tuning session's trials run as the product runs them, without the line below
    with pytest.MonkeyPatch.context() as mp:
        if not torch.cuda.is_available():
            yield Device(torch.device("cpu"), CPU_SIZES, child_env)
            return
        # The numerics check's deterministic cuBLAS workspace (the gate sets it for its worker); cuBLAS reads
        # it when its handle is created, so before any check touches the device.
        mp.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
        yield Device(torch.device("cuda", torch.cuda.current_device()), CUDA_SIZES, child_env)


@pytest.fixture(autouse=True)
def _release_after(device: Device) -> Iterator[None]:
    yield
    device.release()  # an out-of-memory error leaves cached blocks the next check needs


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> dict[str, Any]:
    """What the check measured, for the JSON file; a check that fails keeps what it recorded until then."""
    if request.config.getoption("gpu_json") and hasattr(request.config, "workerinput"):
        pytest.fail("--gpu-json needs one process (-n 0): each xdist worker would write its own checks over the file")
    found: dict[str, Any] = {}
    request.node.user_properties.append(("figures", found))
    return found


def _check_name(item: pytest.Item) -> str:
    """The check a test is: its file's name (one check a file), ``test_meter.py``: ``meter``."""
    return Path(str(item.path)).stem.removeprefix("test_")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The checks in `CHECK_ORDER`, whatever their files' names sort as; other tests keep their places."""
    places = [i for i, item in enumerate(items) if Path(str(item.path)).resolve().parent == _HERE]
    ordered = sorted((items[i] for i in places), key=lambda item: _order(_check_name(item)))
    for i, item in zip(places, ordered, strict=True):
        items[i] = item


def _order(check: str) -> int:
    return CHECK_ORDER.index(check) if check in CHECK_ORDER else len(CHECK_ORDER)


def pytest_collection_finish(session: pytest.Session) -> None:
    checks = [_check_name(i) for i in session.items if "figures" in getattr(i, "fixturenames", ())]
    if checks and not session.config.option.collectonly:
        session.config.stash[_EXPECTED] = checks
        session.config.stash[_STARTED] = time.perf_counter()
        session.config.stash[_RESULTS] = {}
        _write(session.config)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    found = dict(item.user_properties).get("figures")
    results = item.config.stash.get(_RESULTS, None)
    if found is None or results is None:
        return report
    entry = results.setdefault(
        _check_name(item), {"test": item.nodeid, "status": "passed", "seconds": 0.0, "error": None, "figures": found}
    )
    entry["seconds"] += report.duration
    if report.failed:
        oom = call.excinfo is not None and is_oom_error(call.excinfo.value)
        entry["status"] = "oom" if oom else "failed" if report.when == "call" else "error"
        entry["error"] = _message(report)
    elif report.skipped:
        entry["status"], entry["error"] = "skipped", _message(report)
    if report.when == "teardown":
        _write(item.config)  # after every check, not only at the end: a run cut short keeps its results
    return report


def _message(report: pytest.TestReport) -> str:
    if isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
        text = str(report.longrepr[2])
    else:
        crash = getattr(report.longrepr, "reprcrash", None)
        text = getattr(crash, "message", None) or (report.longreprtext.strip().splitlines() or [""])[-1]
    text = " ".join(text.split())
    return text if len(text) <= 1000 else text[:997] + "..."


def _write(config: pytest.Config) -> None:
    path = config.getoption("gpu_json")
    if not path or hasattr(config, "workerinput"):
        return
    results, expected = config.stash[_RESULTS], config.stash[_EXPECTED]
    complete = all(name in results for name in expected)
    report = {
        "environment": environment(),
        "complete": complete,
        "passed": complete and all(r["status"] == "passed" for r in results.values()),
        "wall_s": time.perf_counter() - config.stash[_STARTED],
        "checks": results,
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_jsonable(report), indent=2), encoding="utf-8")


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
