"""A noisy neighbour for benchmarks and tests: `NoisyNeighbour` spins seeded busy and idle spells on every
core; `LoadModel` is the same pattern as a slowdown factor, for tests that patch the clock.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["LoadModel", "NoisyNeighbour", "noisy_neighbour"]


@dataclass(frozen=True)
class LoadModel:
    """Spells of load as a slowdown: ``factor(t)`` is 1 when idle, ``1 + busy_slowdown`` when busy (seeded)."""

    seed: int = 0
    busy_s: float = 2.0
    idle_s: float = 3.0
    busy_slowdown: float = 0.6
    """How much slower a step runs during a busy spell (0.6: 60% slower)."""
    horizon_s: float = 100_000.0

    def spells(self) -> Iterator[tuple[float, float, bool]]:
        rng = random.Random(self.seed)
        t, busy = 0.0, rng.random() < self.busy_s / (self.busy_s + self.idle_s)
        while t < self.horizon_s:
            length = rng.expovariate(1.0 / (self.busy_s if busy else self.idle_s))
            yield t, t + length, busy
            t, busy = t + length, not busy

    def factor(self, t: float) -> float:
        for start, end, busy in self.spells():
            if start <= t < end:
                return 1.0 + self.busy_slowdown if busy else 1.0
        return 1.0


def _spin(seed: int, busy_s: float, idle_s: float, until: float) -> None:
    rng = random.Random(seed)
    busy = rng.random() < 0.5
    while time.monotonic() < until:
        length = rng.expovariate(1.0 / (busy_s if busy else idle_s))
        end = min(until, time.monotonic() + length)
        if busy:
            while time.monotonic() < end:
                pass
        else:
            time.sleep(max(0.0, end - time.monotonic()))
        busy = not busy


class NoisyNeighbour:
    """One process per core spinning in seeded busy spells and sleeping in idle ones, until `stop`.

    Args:
        seed: fixes every process's spell sequence.
        busy_s: mean busy spell, seconds.
        idle_s: mean idle spell, seconds.
        processes: how many (default: one per core).
        max_s: the processes end by themselves after this long.
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        busy_s: float = 2.0,
        idle_s: float = 3.0,
        processes: int | None = None,
        max_s: float = 3600.0,
    ) -> None:
        self.seed, self.busy_s, self.idle_s = seed, busy_s, idle_s
        self.count = processes or os.cpu_count() or 1
        self.max_s = max_s
        self._procs: list[mp.process.BaseProcess] = []

    def start(self) -> None:
        until = time.monotonic() + self.max_s
        ctx = mp.get_context("spawn")  # a clean child: no copy of the caller's torch state
        for i in range(self.count):
            p = ctx.Process(target=_spin, args=(self.seed * 1000 + i, self.busy_s, self.idle_s, until), daemon=True)
            p.start()
            self._procs.append(p)

    def stop(self) -> None:
        for p in self._procs:
            p.terminate()
        for p in self._procs:
            p.join(timeout=10)
        self._procs = []


@contextmanager
def noisy_neighbour(seed: int = 0, **kwargs: float) -> Iterator[NoisyNeighbour]:
    """`NoisyNeighbour` for the duration of a ``with`` block."""
    n = NoisyNeighbour(seed, **kwargs)  # type: ignore[arg-type]
    n.start()
    try:
        yield n
    finally:
        n.stop()
