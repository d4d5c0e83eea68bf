"""What the machine looked like while something was measured (load, CPU clocks, the GPU); best effort, never guessed."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

__all__ = ["machine_state"]


def machine_state(device: str = "cpu") -> dict[str, Any]:
    """``cpu_count`` and, each only where readable, ``load_1m``, ``load_5m``, ``cpu_mhz`` (the mean current
    clock) and on ``cuda`` ``gpu_sm_mhz``, ``gpu_utilization``, ``gpu_processes`` (the others on the device)."""
    state: dict[str, Any] = {"cpu_count": os.cpu_count()}
    with contextlib.suppress(OSError, AttributeError):
        state["load_1m"], state["load_5m"] = (round(x, 2) for x in os.getloadavg()[:2])
    mhz = []
    for path in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_cur_freq"):
        with contextlib.suppress(OSError, ValueError):
            mhz.append(int(path.read_text().strip()) / 1000.0)
    if mhz:
        state["cpu_mhz"] = round(sum(mhz) / len(mhz), 1)
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            # torch.cuda.clock_rate / utilization / list_gpu_processes need pynvml; without it they raise.
            with contextlib.suppress(Exception):
                state["gpu_sm_mhz"] = int(torch.cuda.clock_rate())
            with contextlib.suppress(Exception):
                state["gpu_utilization"] = int(torch.cuda.utilization())
            with contextlib.suppress(Exception):
                mine = f"process {os.getpid():>10}"
                listing = torch.cuda.list_gpu_processes().splitlines()[1:]
                state["gpu_processes"] = [line.strip() for line in listing if line.strip() and mine not in line]
    return state
