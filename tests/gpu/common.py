"""What the GPU acceptance checks share: the sizes of each kind of device, the device they run on, and
the small helpers several checks use (a seeded model, its data, every mode's policy)."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import platform
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_recompute import RecomputePolicy
from lightning_recompute.reference import ReferenceGPT, SyntheticTokens
from lightning_recompute.units import format_bytes


@dataclass(frozen=True)
class Sizes:
    """Every size the checks use on one kind of device."""

    model: dict[str, Any]
    """`ReferenceGPT` arguments of the meter and offload checks (a few hundred MB of weights on CUDA)."""
    batch: int
    timed_steps: int
    """The offload check's timed steps per policy (after two warm-up steps)."""
    numerics_model: dict[str, Any]
    numerics_batch: int
    numerics_precisions: tuple[str, ...]
    session_model: dict[str, Any]
    """Also the in-job check's model."""
    session_batch: int
    session_trials: int
    session_timeout_s: float
    session_race: dict[str, Any]
    """The session recipe's ``race`` section: short, so the check fits its time (the race's statistics are
    tested elsewhere; here it must run on the device and give figures)."""
    plan_model: dict[str, Any]
    plan_dtype: torch.dtype
    card_bytes: int | None
    """The planner check's device memory; ``None``: the device's own (a CPU has none, so the dry run pretends)."""
    compile_model: dict[str, Any]
    compile_batch: int
    compile_backend: str | None
    """``None``: torch.compile's default (Inductor)."""


def gpt(vocab: int, seq: int, layers: int, width: int, heads: int, dropout: float) -> dict[str, Any]:
    return {
        "vocab_size": vocab,
        "seq_len": seq,
        "n_layer": layers,
        "n_embd": width,
        "n_head": heads,
        "dropout": dropout,
        "attention": "sdpa",
    }


CUDA_SIZES = Sizes(
    # 136M parameters (544 MB in fp32); a step peaks near 9 GB with every activation kept.
    model=gpt(16384, 1024, 8, 1024, 16, 0.1),
    batch=8,
    timed_steps=6,
    numerics_model=gpt(8192, 512, 4, 512, 8, 0.1),
    numerics_batch=8,
    # bf16-mixed, what the GPU recipes train in, runs SDPA's flash kernels; fp32 its memory-efficient ones.
    numerics_precisions=("bf16-mixed", "32-true"),
    session_model=gpt(8192, 512, 4, 512, 8, 0.1),
    session_batch=8,
    session_trials=4,
    session_timeout_s=330.0,
    session_race={"max_rounds": 16, "estimate_rounds": 10, "time_s": 45.0},
    # ~0.94B parameters in bf16; about 2.6 GB of activations per sample with every one kept.
    plan_model=gpt(32768, 2048, 16, 2048, 16, 0.0),
    plan_dtype=torch.bfloat16,
    card_bytes=None,
    compile_model=gpt(8192, 512, 4, 512, 8, 0.0),
    compile_batch=8,
    compile_backend=None,
)

CPU_SIZES = Sizes(
    model=gpt(128, 32, 4, 32, 4, 0.1),
    batch=4,
    timed_steps=2,
    numerics_model=gpt(128, 32, 2, 32, 4, 0.1),
    numerics_batch=2,
    numerics_precisions=("32-true",),
    session_model=gpt(128, 32, 4, 32, 4, 0.1),
    session_batch=4,
    session_trials=3,
    session_timeout_s=400.0,  # the limit is for a hang, not for a busy machine
    session_race={"min_rounds": 4, "max_rounds": 8, "estimate_rounds": 6, "time_s": 20.0},
    plan_model=gpt(128, 64, 3, 32, 4, 0.0),
    plan_dtype=torch.float32,
    card_bytes=4 * 2**20,
    compile_model=gpt(64, 16, 2, 16, 2, 0.0),
    compile_batch=2,
    compile_backend="aot_eager",
)


@dataclass(frozen=True)
class Device:
    """Where the checks run: CUDA when there is one, else the CPU dry run (its sizes and its rules)."""

    torch_device: torch.device
    sizes: Sizes
    child_env: dict[str, str]
    """The environment a child process gets: this process's before the fixture set anything."""

    @property
    def type(self) -> str:
        """The device's type, also Lightning's ``accelerator``: ``cuda`` or ``cpu``."""
        return self.torch_device.type

    @property
    def cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    def release(self) -> None:
        """Free what the last model left (cycles through the Trainer included), so the next measurement
        starts from an empty device. Not on CPU: the ledger counts only what it sees allocated and what
        it is given, so garbage left there changes no figure, and a collection costs ~0.4 s with torch loaded."""
        if self.cuda:
            gc.collect()
            torch.cuda.synchronize(self.torch_device)
            torch.cuda.empty_cache()


def model(cfg: Mapping[str, Any], seed: int = 0, cls: type[ReferenceGPT] = ReferenceGPT) -> ReferenceGPT:
    torch.manual_seed(seed)
    return cls(**cfg)


def data(cfg: Mapping[str, Any], batch: int, num_batches: int = 16) -> SyntheticTokens:
    return SyntheticTokens(
        vocab_size=cfg["vocab_size"], seq_len=cfg["seq_len"], batch_size=batch, num_batches=num_batches
    )


def layer_names(cfg: Mapping[str, Any]) -> list[str]:
    return [f"blocks.{i}" for i in range(cfg["n_layer"])]


def mixed(names: Sequence[str]) -> RecomputePolicy:
    """Every mode at least once when there are four layers or more: full, selective, offload, none, ..."""
    cycle = ("full", "selective", "offload", "none")
    return RecomputePolicy.from_modes({n: cycle[i % len(cycle)] for i, n in enumerate(names)})


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        # Offload's "no effect on CPU" notice, Lightning's advice on workers and logging: the checks assert.
        warnings.simplefilter("ignore")
        yield


def rel(a: float, b: float) -> float:
    return abs(a - b) / b if b else math.inf


def recipe_dict(model: Mapping[str, Any], batch: int, accelerator: str, precision: str, **extra: Any) -> dict[str, Any]:
    """A tuner recipe of `ReferenceGPT` on `SyntheticTokens`; ``extra`` adds or replaces sections."""
    return {
        "name": extra.pop("name", "gpu-acceptance"),
        "model": {"class_path": "lightning_recompute.reference.ReferenceGPT", "init_args": dict(model)},
        "data": {
            "class_path": "lightning_recompute.reference.SyntheticTokens",
            "init_args": {"vocab_size": model["vocab_size"], "seq_len": model["seq_len"], "batch_size": batch},
        },
        "trainer": {"accelerator": accelerator, "precision": precision},
        "budget": extra.pop("budget", {"value": "1GiB"}),
        **extra,
    }


def environment() -> dict[str, Any]:
    """Device, driver, torch and CUDA versions: the header of a run, and of its JSON."""
    import lightning

    env: dict[str, Any] = {
        "device": "cpu",
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            memory=format_bytes(int(props.total_memory)),
            memory_bytes=int(props.total_memory),
            cudnn=torch.backends.cudnn.version(),
            cuda_driver_api=getattr(torch._C, "_cuda_getDriverVersion", lambda: None)(),
            driver=_nvidia_driver(),
        )
    return env


def _nvidia_driver() -> str | None:
    """The NVIDIA kernel module's version, from /proc (no nvidia-smi needed)."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text(encoding="utf-8")
    except OSError:
        return None
    for word in text.split():
        if word[:1].isdigit() and "." in word:
            return word
    return None
