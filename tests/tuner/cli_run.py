"""Running ``recompute-tune`` as a user does, in a child interpreter on a tiny recipe; pipes read with deadlines."""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import yaml

from tests.helpers import RACE_PLAN_ENV, SHORT_RACE, child_env

TINY = {
    "model": {"init_args": {"n_layer": 3, "n_embd": 32, "seq_len": 32, "n_head": 2, "dropout": 0.0}},
    "data": {"init_args": {"batch_size": 4, "num_batches": 8}},
    "budget": "64MiB",
    "search": {"n_trials": 3, "seed": 0},
    "trial": {"warmup_steps": 1, "measure_steps": 2, "timeout_s": 120, "env": {"OMP_NUM_THREADS": "1"}},
}


def write_recipe(folder: Path, **overrides) -> Path:
    data = json.loads(json.dumps(TINY))
    for key, value in overrides.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and key in data else value
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tuner", *args]


def run_cli(
    folder: Path, *args: str, timeout: float = 800, race: dict | None = None
) -> subprocess.CompletedProcess[str]:
    """``recompute-tune ARGS`` in ``folder``; ``race``: `RacePlan` fields over `SHORT_RACE`."""
    env = child_env(**{RACE_PLAN_ENV: json.dumps({**SHORT_RACE, **(race or {})})})
    return subprocess.run(
        command(*args), check=False, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout
    )


class Drain:
    """Reads a child's pipe to its end on a thread, so every wait on it can have a deadline."""

    def __init__(self, pipe: IO[str] | None) -> None:
        assert pipe is not None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._seen: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe: IO[str]) -> None:
        for line in pipe:
            self._lines.put(line)
        self._lines.put(None)  # end of output

    def wait_for_line(self, prefix: str, timeout_s: float) -> bool:
        """Whether a line starting with ``prefix`` arrives before ``timeout_s`` (and before the end)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                return False
            if line is None:
                return False
            self._seen.append(line)
            if line.startswith(prefix):
                return True
        return False

    def finish(self, timeout_s: float) -> str:
        """Everything the pipe carried, once the child closed it (within ``timeout_s``)."""
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the child's pipe stayed open past the deadline"
        while (line := self._lines.get_nowait()) is not None:
            self._seen.append(line)
        return "".join(self._seen)

    def text(self) -> str:
        """What has been read so far, without waiting."""
        with contextlib.suppress(queue.Empty):
            while (line := self._lines.get_nowait()) is not None:
                self._seen.append(line)
        return "".join(self._seen)
