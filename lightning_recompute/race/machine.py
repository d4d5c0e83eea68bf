"""What the machine looked like while something was measured (load, CPU clocks, the GPU); best effort, never guessed."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

__all__ = ["machine_state"]

_CPUFREQ = Path("/sys/devices/system/cpu")


def machine_state(device: str = "cpu") -> dict[str, Any]:
    """The load average, the mean current CPU clock, and on CUDA the device's clocks and other processes.

    Keys, each only where readable: ``load_1m``, ``load_5m``, ``cpu_count``, ``cpu_mhz``; on ``cuda``
    ``gpu_sm_mhz``, ``gpu_utilization``, ``gpu_processes``.
    """
    state: dict[str, Any] = {"cpu_count": os.cpu_count()}
    with contextlib.suppress(OSError, AttributeError):
        one, five, _ = os.getloadavg()
        state["load_1m"], state["load_5m"] = round(one, 2), round(five, 2)
    mhz = _cpu_mhz()
    if mhz is not None:
        state["cpu_mhz"] = mhz
    if device.startswith("cuda"):
        state.update(_gpu_state())
    return state


def _cpu_mhz() -> float | None:
    values = []
    for path in _CPUFREQ.glob("cpu[0-9]*/cpufreq/scaling_cur_freq"):
        with contextlib.suppress(OSError, ValueError):
            values.append(int(path.read_text().strip()) / 1000.0)
    return round(sum(values) / len(values), 1) if values else None


def _gpu_state() -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        import torch

        if not torch.cuda.is_available():
            return out
        # torch.cuda.clock_rate / utilization / list_gpu_processes need pynvml; without it they raise.
        with contextlib.suppress(Exception):
            out["gpu_sm_mhz"] = int(torch.cuda.clock_rate())
        with contextlib.suppress(Exception):
            out["gpu_utilization"] = int(torch.cuda.utilization())
        with contextlib.suppress(Exception):
            listing = torch.cuda.list_gpu_processes().splitlines()[1:]
            mine = f"process {os.getpid():>10}"
            out["gpu_processes"] = [line.strip() for line in listing if line.strip() and mine not in line]
    except ImportError:
        pass
    return out
