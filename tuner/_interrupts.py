"""Ctrl-C: the first press finishes the trial in flight, the second (or SIGTERM, SIGHUP) kills it; between
trials the loop is only asked to stop, so no Optuna or MLflow write is cut."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, Literal, TypeVar, cast

from tuner._liveness import kill_point

_F = TypeVar("_F", bound=Callable[..., Any])

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
Phase = Literal["setup", "trial", "between", "gate"]


class Interrupts:
    def __init__(self, notify: Callable[[str], None]) -> None:
        self.stop = threading.Event()  # set by the first press: the loop stops before the next trial
        self.presses = 0
        self.phase: Phase = "setup"
        self._notify = notify

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.presses += 1
        self.stop.set()
        kill = signum != signal.SIGINT or self.presses > 1 or self.phase in ("setup", "gate")
        if self.phase == "between":
            self._say("interrupt: stopping")
        elif not kill:  # in a trial
            self._say("interrupt: finishing the current trial, then stopping (Ctrl-C again to kill it)")
        else:
            self._say("interrupt: stopping now")
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def during(self, phase: Phase) -> Iterator[None]:
        """Be in ``phase`` for the ``with`` block, and "between" after it, however it ends."""
        self.phase = phase
        try:
            yield
        finally:
            self.phase = "between"

    def stoppable(self, fn: _F) -> _F:
        """``fn`` run in the "gate" phase, so the first Ctrl-C stops it."""

        def call(*args: Any, **kwargs: Any) -> Any:
            with self.during("gate"):
                kill_point("gate")  # a test hook; see tuner._liveness
                return fn(*args, **kwargs)

        return cast("_F", call)

    def _say(self, text: str) -> None:
        # After SIGHUP the terminal may be gone: a write failing must not stop the orderly shutdown.
        with contextlib.suppress(OSError):
            self._notify(text)

    @contextlib.contextmanager
    def installed(self) -> Iterator[Interrupts]:
        """Install the handler for SIGINT, SIGTERM and SIGHUP (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self.handle) for s in STOP_SIGNALS}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
