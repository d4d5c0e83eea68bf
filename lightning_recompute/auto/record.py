"""What a job that tuned itself leaves behind: the policy file and the MLflow record (docs/AUTO.md).

The record has a tuning session's layout; one that cannot be written is a warning, and the job trains on.
"""

from __future__ import annotations

import contextlib
import logging
from importlib.metadata import entry_points
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_warn

from lightning_recompute.auto.callback import AutoRecompute
from lightning_recompute.race import RaceResult
from lightning_recompute.tuned_for import TunedFor

__all__ = ["JobTuning", "record_decision"]

_log = logging.getLogger(__name__)

JobTuning = AutoRecompute
"""What the service's record (`tuner._job_record`) reads once the job decided: the callback itself."""


def record_decision(auto: AutoRecompute, race: RaceResult, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    """Write the policy file (when asked) and the MLflow record (when there is a store); its run's id in `auto`."""
    assert auto.decision is not None
    device = torch.cuda.get_device_name(pl_module.device) if pl_module.device.type == "cuda" else "cpu"
    micro_batch = auto.records[-1].samples if auto.records else None  # the last tuning step's
    policy = auto.decision.policy
    if auto.output is not None:
        peak = race.entrants[policy.fingerprint()].peak_bytes
        tuned = TunedFor(micro_batch, micro_batch, peak_bytes=peak, limit_bytes=auto.limit_bytes, device=device)
        try:
            policy.with_tuned_for(tuned).save(auto.output)
        except OSError as err:
            rank_zero_warn(f"AutoRecompute: could not write the policy file {auto.output}: {err}")
    target: tuple[str, str, str | None] | None = None
    if auto.tracking_uri is not None:
        target = auto.tracking_uri, auto.experiment or "auto-recompute", None
    for logger in trainer.loggers if target is None else ():
        if isinstance(logger, MLFlowLogger):
            experiment = auto.experiment or logger.experiment.get_experiment(logger.experiment_id).name
            target = logger.experiment.tracking_uri, experiment, logger.run_id
            break
    if target is None:
        return
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
            return
        auto.name = auto.name or f"auto-{type(pl_module).__name__}"
        auto.record_run_id = recorder(auto, trainer, pl_module, race, device, target)
    except Exception as err:  # noqa: BLE001 - the record is a by-product; the job must train on
        _log.debug("AutoRecompute record failed", exc_info=True)
        rank_zero_warn(f"AutoRecompute: the MLflow record was not written ({type(err).__name__}: {err})")
