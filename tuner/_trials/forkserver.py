"""A warm process that imports torch and Lightning once and forks each one-rank CPU trial worker from them
(docs/TUNER.md, "Forked trial processes"). Not ``multiprocessing``'s forkserver: its children re-import the
parent's ``__main__``, write to the parent's terminal and hide the exit status behind pickling.

The protocol is one JSON object per line: ``{"argv", "env", "log"}`` or ``{"kill": PID}`` in, ``{"pid"}``
once forked and ``{"pid", "returncode"}`` once exited out, one worker at a time. Forked workers share the
server's hash seed and numpy's global random state; nothing in `PRELOAD` may start an OpenMP pool at import.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping, Sequence
from typing import IO, Any

FORK_SERVER_ENV = "RECOMPUTE_TUNE_FORK_SERVER"
"""``0`` (or ``off``, ``false``, ``no``): every worker is a fresh interpreter; otherwise one-rank CPU workers fork."""
SERVER_PARENT_ENV = "RECOMPUTE_TUNE_FORK_SERVER_PARENT"
"""In the server's environment (and so in a forked worker's ``/proc`` one), the pid of the process it follows."""

PRELOAD: tuple[str, ...] = ("torch", "lightning", "lightning_recompute", "tuner._trials.worker")
PRELOAD += ("lightning_recompute.race.schedule", "tuner.recipe")
"""What the server imports before forking: what every worker imports before its first step."""

_SERVE = "import sys, tuner._trials.forkserver as s; sys.exit(s.serve(sys.argv[1:]))"
"""The server's command (``-c``, not ``-m``: the package imports this module before runpy would run it)."""
_START_TIMEOUT_S = 300.0  # imports on a loaded machine; a server that takes longer is not worth waiting for
_REPLY_TIMEOUT_S = 60.0  # a fork takes milliseconds; anything else is a server in trouble
_log = logging.getLogger(__name__)


class ForkServerError(RuntimeError):
    """The fork server could not start or stopped answering; workers start as fresh interpreters instead."""


# RuntimeError: a ForkServerError, or a reader thread that cannot start.
_FAILED = (RuntimeError, OSError, ValueError, KeyError, TypeError, subprocess.TimeoutExpired)


def kill_group(pid: int, *, leader: bool = False) -> None:
    """SIGKILL process group ``pid`` and, with ``leader``, process ``pid`` in case it has not made its group yet."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    if leader:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


class Forked:
    """One worker forked by a `ForkServer`: the part of ``subprocess.Popen`` the runner uses."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid  # also its process group and session id
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_status(self.pid, timeout)
        return self.returncode

    def kill_group(self) -> None:
        """While the server lives it kills the group: only it knows whether it has reaped the worker, so only it
        can kill that pid without risking a process that reuses it. With the server gone, so is the worker."""
        if not self._server.alive:
            kill_group(self.pid)
        elif self.returncode is None:
            try:
                self._server.send({"kill": self.pid})
            except (OSError, ValueError):
                self._server.abandon()  # a server that cannot be told is ended, and its worker with it


class ForkServer:
    """A server process started with ``env`` in ``cwd``, forking workers on request, one at a time;
    `ForkServerError` when it does not come up (its output's tail says why)."""

    def __init__(self, env: Mapping[str, str], cwd: str) -> None:
        self.env, self.cwd = dict(env), cwd
        self._busy = threading.Lock()
        self._broken = False
        self._replies: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        # Its output: a file, as a pipe could fill and block it; unlinked, so that nothing is left behind.
        self._log, path = tempfile.mkstemp(prefix="recompute-forkserver-", suffix=".log")
        os.unlink(path)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _SERVE, *PRELOAD],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log,
                cwd=cwd,
                env={**self.env, SERVER_PARENT_ENV: str(os.getpid())},
                start_new_session=True,  # a Ctrl-C in the terminal is the tuner's to handle, not the server's
            )
            assert self._proc.stdin is not None and self._proc.stdout is not None  # both are pipes
            self._stdin = self._proc.stdin
            threading.Thread(target=self._read_replies, args=(self._proc.stdout,), daemon=True).start()
            self.pid = int(self._reply(_START_TIMEOUT_S)["ready"])
        except _FAILED as err:
            output = self._tail()
            if hasattr(self, "_proc"):
                self.abandon()
                self._stdin.close()
            os.close(self._log)
            raise ForkServerError(f"fork server did not come up: {err}; its output: {output}") from err

    @property
    def busy(self) -> bool:
        """Whether a worker of this server is running."""
        return self._busy.locked()

    @property
    def alive(self) -> bool:
        """Whether the server is still running and its replies can be trusted."""
        return not self._broken and self._proc.poll() is None

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], log_path: str) -> Forked | None:
        """Fork a worker running ``tuner._trials.worker.main(argv)`` with ``env``, its output to ``log_path``.

        ``None`` while another worker of this server runs, or when the server does not answer; it is then
        ended, so that no reply of it is ever read out of turn.
        """
        if not self._busy.acquire(blocking=False):
            return None
        try:
            if not self.alive:
                raise ForkServerError(f"fork server gone; its output: {self._tail()}")
            self.send({"argv": list(argv), "env": dict(env), "log": log_path})
            return Forked(self, int(self._reply(_REPLY_TIMEOUT_S)["pid"]))
        except BaseException as err:
            try:
                self.abandon()
            finally:
                self._busy.release()
            if not isinstance(err, _FAILED):
                raise
            _log.warning("fork server did not fork: %s; this worker starts as a fresh interpreter", err)
            return None

    def exit_status(self, pid: int, timeout: float | None) -> int:
        """Wait for worker ``pid`` to exit (``subprocess.TimeoutExpired`` past ``timeout``) and release the server."""
        try:
            reply = self._reply(timeout)
            while reply.get("pid") != pid or "returncode" not in reply:
                reply = self._reply(timeout)
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(f"worker {pid}", timeout or 0.0) from None
        except (ForkServerError, ValueError):
            # The server died or garbled its reply, and the worker with it: read as killed; its result decides.
            try:
                self.abandon()
            finally:
                self._busy.release()
            return -signal.SIGKILL
        self._busy.release()
        return int(reply["returncode"])

    def close(self) -> None:
        """End the server (and a worker still running) by closing its stdin; killed if it lingers."""
        with contextlib.suppress(OSError, ValueError):
            self._stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.abandon()
        if not self.busy:  # a thread waiting on a worker of it may still read the log's tail
            with contextlib.suppress(OSError):
                os.close(self._log)

    def send(self, message: Mapping[str, Any]) -> None:
        self._stdin.write((json.dumps(message) + "\n").encode())
        self._stdin.flush()

    def abandon(self) -> None:
        """Kill the server now (a worker of it follows) and never use it again."""
        self._broken = True
        if self._proc.poll() is None:  # not yet reaped: its pid is still its own
            kill_group(self._proc.pid)
        self._proc.wait()

    def _read_replies(self, stdout: IO[bytes]) -> None:
        try:
            with stdout:
                for line in stdout:
                    self._replies.put(line)
        finally:
            self._replies.put(b"")  # its end, also when reading fails: a waiter must not wait for ever

    def _reply(self, timeout: float | None) -> dict[str, Any]:
        """The server's next line; ``subprocess.TimeoutExpired`` past ``timeout``, `ForkServerError` at its end."""
        try:
            line = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise subprocess.TimeoutExpired("fork server", timeout or 0.0) from None
        if not line:
            self._replies.put(line)  # the end, for whoever reads next
            raise ForkServerError(f"fork server exited ({self._proc.wait()})")
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise ForkServerError(f"fork server said {line!r}, not a reply")
        return reply

    def _tail(self) -> str:
        try:  # pread: the server writes through the same file offset
            text = os.pread(self._log, 8000, max(0, os.fstat(self._log).st_size - 8000)).decode(errors="replace")
            return text[-2000:].strip() or "(none)"
        except (OSError, ValueError):
            return "(unreadable)"


_OFF = frozenset({"0", "off", "false", "no"})
_warned: set[str] = set()  # values of the variable already warned about, once each
_shared_lock = threading.Lock()
_shared: ForkServer | None = None
_refused: list[tuple[dict[str, str], str]] = []  # environments a server would not start with: not tried again


def forking(env: Mapping[str, str]) -> bool:
    """Whether forking is on for ``env``; a value neither on nor off keeps it on, with a warning naming it once."""
    value = env.get(FORK_SERVER_ENV, "").strip().lower()
    if value in _OFF:
        return False
    if value not in ("", "1", "on", "true", "yes") and value not in _warned:
        _warned.add(value)
        _log.warning(
            "%s=%r is neither on (1, on, true, yes) nor off (0, off, false, no); forking stays on",
            FORK_SERVER_ENV,
            env[FORK_SERVER_ENV],
        )
    return True


def shared(env: Mapping[str, str], cwd: str) -> ForkServer | None:
    """This process's fork server for ``env`` and ``cwd``: started on first use, replaced for another
    environment or folder, never while a worker of it runs; ``None`` where forking is off, it is busy or
    would not start (a fresh interpreter then)."""
    global _shared
    if not forking(env) or (dict(env), cwd) in _refused:
        return None
    with _shared_lock:
        if _shared is not None and (_shared.env != env or _shared.cwd != cwd or not _shared.alive):
            if _shared.busy:
                return None  # a worker of it runs on (closing the server would end it): this one starts fresh
            _shared.close()
            _shared = None
        if _shared is None:
            try:
                _shared = ForkServer(env, cwd)
            except ForkServerError as err:
                _refused.append((dict(env), cwd))
                _log.warning("%s; trial workers start as fresh interpreters", err)
        return _shared


@atexit.register
def _close_shared() -> None:
    global _shared
    with _shared_lock:
        if _shared is not None:
            _shared.close()
            _shared = None


# ---------------------------------------------------------------------------------------------- the server


def serve(preload: Sequence[str]) -> int:
    """The server's loop: import ``preload``, then fork one worker per request until its parent is gone.

    Gone: its stdin ends, or its parent pid changes (a fork of the parent may hold stdin open). Not
    ``PR_SET_PDEATHSIG``: that follows the *thread* that started the server, which may end first.
    """
    # Replies go to a copy of stdout; stdout becomes stderr, so nothing an import prints is taken for a reply.
    replies = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    parent = os.environ.get(SERVER_PARENT_ENV, "")
    parent_pid = int(parent) if parent.isdigit() else os.getppid()
    os.close(os.pidfd_open(os.getpid()))  # Linux 5.3 or later; before, no server: workers start fresh
    for name in preload:
        __import__(name)
    replies.write(json.dumps({"ready": os.getpid()}) + "\n")
    spawns: list[dict[str, Any]] = []
    buffer, ended, worker, exited = b"", False, 0, -1
    while not ended and os.getppid() == parent_pid:
        if not worker and spawns:
            request = spawns.pop(0)
            worker = os.fork()
            if worker == 0:
                _child(request, replies)  # never returns
            exited = os.pidfd_open(worker)  # readable once it has exited; waiting on it does not reap it
            replies.write(json.dumps({"pid": worker}) + "\n")
        readable, _, _ = select.select([0, exited] if worker else [0], [], [], 1.0)
        if worker and exited in readable:
            replies.write(json.dumps({"pid": worker, "returncode": _reap(worker, exited)}) + "\n")
            worker = 0
        if 0 in readable:
            chunk = os.read(0, 65536)
            ended = not chunk
            *lines, buffer = (buffer + chunk).split(b"\n")
            for message in map(json.loads, lines):
                if "argv" in message:
                    spawns.append(message)
                elif worker and message.get("kill") == worker:  # kills of workers already reported are dropped
                    kill_group(worker, leader=True)
    if worker:
        _reap(worker, exited)  # the parent is gone
    return 0


def _reap(pid: int, exited: int) -> int:
    """Kill what the worker left in its group, then reap it: until then its pid, so the group, is its own."""
    kill_group(pid, leader=True)
    os.close(exited)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _child(request: Mapping[str, Any], replies: IO[str]) -> None:
    """In the forked child: become a fresh worker's equivalent, run it, exit with its status."""
    code = 1
    try:
        os.setsid()  # its own session and process group, as `start_new_session=True` gives a fresh worker
        replies.close()
        log = os.open(str(request["log"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        from tuner._trials import worker

        argv = [str(a) for a in request["argv"]]
        sys.argv = [str(worker.__file__), *argv]
        code = worker.main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - whatever happens, the child must not return into the server's loop
        traceback.print_exc()
        code = 1
    finally:
        # What an interpreter does on its way out, then leave without unwinding into the server's frames.
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        with contextlib.suppress(BaseException):
            ctypes.CDLL(None).fflush(None)
        os._exit(code)
