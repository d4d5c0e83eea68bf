"""What a job that tuned itself leaves behind: the policy file and the MLflow record (docs/AUTO.md).

The record has a tuning session's layout; one that cannot be written is a warning, and the job trains on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_warn

from lightning_recompute import RecomputePolicy
from lightning_recompute.auto.candidates import Candidate
from lightning_recompute.layers import LayerSpec
from lightning_recompute.race import RacePlan, RaceResult
from lightning_recompute.tuned_for import TunedFor

__all__ = ["JobTuning", "record_decision", "tracking_target"]

_log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "auto-recompute"


@dataclass(frozen=True)
class JobTuning:
    """What a job's tuning decided and measured: everything the record is made of."""

    policy: RecomputePolicy
    summary: str
    candidates: Sequence[Candidate]
    race: RaceResult
    notes: Sequence[str]
    budget_bytes: int
    limit_bytes: int
    modes: Sequence[str]
    plan: RacePlan
    layers: LayerSpec
    micro_batch: int | None
    """Samples in the job's last tuning batch (the policy's ``tuned_for.micro_batch``)."""
    name: str
    """The session's name in MLflow (the study tag)."""
    output: Path | None
    tracking_uri: str | None
    experiment: str | None


def tracking_target(auto: JobTuning, trainer: L.Trainer) -> tuple[str, str, str | None] | None:
    """Where the record goes: ``(tracking URI, experiment, parent run)``, or ``None`` for nowhere."""
    if auto.tracking_uri is not None:
        return auto.tracking_uri, auto.experiment or DEFAULT_EXPERIMENT, None
    for logger in trainer.loggers:
        if isinstance(logger, MLFlowLogger):
            client = logger.experiment
            experiment = auto.experiment or client.get_experiment(logger.experiment_id).name
            return client.tracking_uri, experiment, logger.run_id
    return None


def record_decision(auto: JobTuning, trainer: L.Trainer, pl_module: L.LightningModule) -> str | None:
    """Write the policy file (when asked) and the MLflow record (when there is a store); the session run's id."""
    race = auto.race
    device = torch.cuda.get_device_name(pl_module.device) if pl_module.device.type == "cuda" else "cpu"
    peak = race.entrants[auto.policy.fingerprint()].peak_bytes
    tuned = TunedFor(
        micro_batch=auto.micro_batch,
        data_batch_size=auto.micro_batch,
        peak_bytes=peak,
        limit_bytes=auto.limit_bytes,
        device=device,
    )
    policy = auto.policy.with_tuned_for(tuned)
    if auto.output is not None:
        try:
            policy.save(auto.output)
        except OSError as err:
            rank_zero_warn(f"AutoRecompute: could not write the policy file {auto.output}: {err}")
    target = tracking_target(auto, trainer)
    if target is None:
        return None
    try:
        # The service's writer, through an entry point: the library imports neither it nor its dependencies.
        recorder: Any = None
        for entry in entry_points(group="lightning_recompute", name="mlflow_record"):
            with contextlib.suppress(ImportError):  # the entry point ships with the library, its dependencies not
                recorder = entry.load()
            break
        if recorder is None:
            rank_zero_warn(
                "AutoRecompute: the race is not recorded in MLflow: the record is written by the tuning service, "
                "install it with `pip install 'lightning-recompute[tune]'`"
            )
            return None
        return recorder(auto, trainer, pl_module, race, device, target)
    except Exception as err:  # noqa: BLE001 - the record is a by-product; the job must train on
        _log.debug("AutoRecompute record failed", exc_info=True)
        rank_zero_warn(f"AutoRecompute: the MLflow record was not written ({type(err).__name__}: {err})")
        return None
