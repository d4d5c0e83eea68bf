"""RecomputeCallback with a real Trainer on CPU: logging, CLI config, checkpoints, configure_model, DDP."""

from __future__ import annotations

import csv
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_recompute import (
    IncompatibleModelError,
    Mode,
    RecomputeCallback,
    RecomputeError,
    RecomputePolicy,
    applied_policy,
    apply_policy,
)
from lightning_recompute.reference import Block, ReferenceGPT, SyntheticTokens

TINY = dict(vocab_size=64, seq_len=16, n_layer=3, n_embd=32, n_head=4, dropout=0.1)
DATA = dict(vocab_size=64, seq_len=16, batch_size=4, num_batches=8)


def test_fit_logs_memory_time_and_throughput_through_the_logger(
    quiet_trainer: Callable[..., L.Trainer], tmp_path: Path
) -> None:
    cb = RecomputeCallback({"version": 1, "layers": {"blocks.0": "full", "blocks.*": "selective"}})
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer = quiet_trainer(callbacks=[cb], max_steps=4, logger=logger, log_every_n_steps=1)
    model = ReferenceGPT(**TINY)
    trainer.fit(model, SyntheticTokens(**DATA))
    assert applied_policy(model).modes == {
        "blocks.0": Mode.FULL,
        "blocks.1": Mode.SELECTIVE,
        "blocks.2": Mode.SELECTIVE,
    }
    with open(tmp_path / "run" / "version_0" / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    logged = [r for r in rows if r.get("recompute/step_time_s")]
    assert len(logged) == 4
    for row in logged:
        assert float(row["recompute/step_time_s"]) > 0
        assert float(row["recompute/peak_memory_bytes"]) > 0
        tokens = float(row["recompute/tokens_per_s"])
        samples = float(row["recompute/samples_per_s"])
        assert tokens == pytest.approx(samples * DATA["seq_len"], rel=1e-4)
    assert [r.samples for r in cb.records] == [4] * 4 and [r.tokens for r in cb.records] == [64] * 4


def test_peak_memory_logged_per_step_orders_the_modes(quiet_trainer: Callable[..., L.Trainer], tmp_path: Path) -> None:
    peaks = {}
    for mode in ("none", "selective", "full"):
        cb = RecomputeCallback(RecomputePolicy.uniform(mode))
        torch.manual_seed(0)
        quiet_trainer(callbacks=[cb], max_steps=2).fit(ReferenceGPT(**TINY), SyntheticTokens(**DATA))
        peaks[mode] = cb.records[-1].peak_bytes
    assert peaks["none"] > peaks["selective"] > peaks["full"]


def test_step_time_and_throughput_from_a_patched_clock(
    quiet_trainer: Callable[..., L.Trainer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = iter(float(i) * 0.5 for i in range(1000))  # every reading 0.5 s after the previous
    monkeypatch.setattr("lightning_recompute.meter.perf_counter", lambda: next(clock))
    cb = RecomputeCallback(RecomputePolicy.uniform("full"), measure_memory=False)
    quiet_trainer(callbacks=[cb], max_steps=3).fit(ReferenceGPT(**TINY), SyntheticTokens(**DATA))
    assert [r.seconds for r in cb.records] == [0.5, 0.5, 0.5]
    assert [r.peak_bytes for r in cb.records] == [None] * 3
    assert cb.records[0].samples_per_s == 8.0 and cb.records[0].tokens_per_s == 128.0


def test_memory_measured_only_on_the_chosen_steps(quiet_trainer: Callable[..., L.Trainer], tmp_path: Path) -> None:
    cb = RecomputeCallback(RecomputePolicy.uniform("full"), memory_steps={1, 2})
    quiet_trainer(callbacks=[cb], max_steps=4).fit(ReferenceGPT(**TINY), SyntheticTokens(**DATA))
    peaks = [r.peak_bytes for r in cb.records]
    assert peaks[0] is None and peaks[3] is None
    # steady once AdamW's state exists (to a few bytes: scalar tensors such as the logged loss)
    assert peaks[1] is not None and peaks[1] == pytest.approx(peaks[2], abs=64)


def test_samples_only_batches_report_no_tokens(quiet_trainer: Callable[..., L.Trainer], tmp_path: Path) -> None:
    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.layers(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 8)), batch_size=3)
    cb = RecomputeCallback(RecomputePolicy.uniform("full"))
    quiet_trainer(callbacks=[cb], max_steps=2).fit(Regressor(), data)
    assert [(r.samples, r.tokens) for r in cb.records] == [(3, None), (3, None)]


def test_lightning_cli_yaml_with_the_callback(tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    policy = RecomputePolicy.from_modes({"blocks.1": "selective"}).save(tmp_path / "policy.yaml")
    config = tmp_path / "config.yaml"
    config.write_text(
        textwrap.dedent(
            f"""
            trainer:
              accelerator: cpu
              max_steps: 2
              logger: false
              enable_checkpointing: false
              enable_progress_bar: false
              default_root_dir: {tmp_path}
              callbacks:
                - class_path: lightning_recompute.RecomputeCallback
                  init_args:
                    policy: {policy}
            model:
              class_path: lightning_recompute.reference.ReferenceGPT
              init_args: {{vocab_size: 64, seq_len: 16, n_layer: 2, n_embd: 32, n_head: 4}}
            data:
              class_path: lightning_recompute.reference.SyntheticTokens
              init_args: {{vocab_size: 64, seq_len: 16, batch_size: 2, num_batches: 4}}
            """
        )
    )
    cli = LightningCLI(args=["fit", "--config", str(config)], save_config_callback=None)
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, RecomputeCallback)]
    assert cb.applied.modes == {"blocks.0": Mode.NONE, "blocks.1": Mode.SELECTIVE}
    assert len(cb.records) == 2


def test_save_under_one_policy_resume_under_another(quiet_trainer: Callable[..., L.Trainer], tmp_path: Path) -> None:
    first = RecomputeCallback(RecomputePolicy.uniform("full"))
    trainer = quiet_trainer(callbacks=[first], max_steps=2)
    trainer.fit(ReferenceGPT(**TINY), SyntheticTokens(**DATA))
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)["callbacks"]
    assert any(v.get("fingerprint") == first.policy.fingerprint() for v in state.values())

    second = RecomputeCallback(RecomputePolicy.uniform("selective"))
    with pytest.warns(
        UserWarning,
        match=(
            rf"written under recompute policy {first.policy.fingerprint()}; "
            rf"resuming under {second.policy.fingerprint()}"
        ),
    ):
        quiet_trainer(callbacks=[second], max_steps=4).fit(
            ReferenceGPT(**TINY), SyntheticTokens(**DATA), ckpt_path=ckpt
        )
    assert second.records[-1].step == 3
    # the same checkpoint loads into a model that never saw the plugin
    plain = ReferenceGPT(**TINY)
    plain.load_state_dict(torch.load(ckpt, weights_only=False)["state_dict"])


class _BuiltLate(ReferenceGPT):
    """Builds its blocks in configure_model, as FSDP / ModelParallel users do."""

    def __init__(self, apply_here: RecomputePolicy | None = None) -> None:
        super().__init__(**{**TINY, "n_layer": 1})
        del self.blocks
        self.apply_here = apply_here

    def configure_model(self) -> None:
        if hasattr(self, "blocks"):
            return
        self.blocks = nn.ModuleList(Block(32, 4, 0.1, "eager", 4, 32) for _ in range(3))
        if self.apply_here is not None:
            apply_policy(self, self.apply_here)


def test_models_built_in_configure_model_get_the_policy(
    quiet_trainer: Callable[..., L.Trainer], tmp_path: Path
) -> None:
    cb = RecomputeCallback(RecomputePolicy.uniform("full"))
    model = _BuiltLate()
    quiet_trainer(callbacks=[cb], max_steps=1).fit(model, SyntheticTokens(**DATA))
    assert set(applied_policy(model).modes.values()) == {Mode.FULL}


def test_policy_applied_in_configure_model_wins_and_differences_are_reported(
    quiet_trainer: Callable[..., L.Trainer], tmp_path: Path
) -> None:
    cb = RecomputeCallback(RecomputePolicy.uniform("full"))
    model = _BuiltLate(apply_here=RecomputePolicy.uniform("selective"))
    with pytest.warns(UserWarning, match="the one applied in configure_model is in effect"):
        quiet_trainer(callbacks=[cb], max_steps=1).fit(model, SyntheticTokens(**DATA))
    assert set(applied_policy(model).modes.values()) == {Mode.SELECTIVE}
    assert len(cb.records) == 1


def test_sharded_strategy_with_late_layers_explains_where_to_apply() -> None:
    FSDPStrategy = type("FSDPStrategy", (), {})
    cb = RecomputeCallback(RecomputePolicy.uniform("full"))
    cb._deferred = True
    with pytest.raises(
        RecomputeError, match=r"Call `lightning_recompute.apply_policy\(self, policy\)` at the end of configure_model"
    ):
        cb._finish_deferred(SimpleNamespace(strategy=FSDPStrategy()), _BuiltLate())


def test_strategy_activation_checkpointing_conflicts() -> None:
    from lightning.pytorch.strategies import FSDPStrategy

    strategy = FSDPStrategy(activation_checkpointing_policy={Block})
    cb = RecomputeCallback(RecomputePolicy.uniform("full"))
    with pytest.raises(IncompatibleModelError, match="activation_checkpointing_policy set"):
        cb.setup(SimpleNamespace(strategy=strategy), ReferenceGPT(**TINY), "fit")


def test_bad_policy_path_fails_at_construction(tmp_path: Path) -> None:
    with pytest.raises(RecomputeError, match=r"missing\.yaml: policy file not found"):
        RecomputeCallback(tmp_path / "missing.yaml")


DDP_SCRIPT = """
import sys, torch, lightning as L
from lightning_recompute import QUIET_TRAINER, RecomputeCallback, RecomputePolicy, applied_policy
from lightning_recompute.reference import ReferenceGPT, SyntheticTokens

if __name__ == "__main__":
    torch.manual_seed(0)
    cb = RecomputeCallback(RecomputePolicy.from_modes({"blocks.0": "full", "blocks.1": "selective"}))
    model = ReferenceGPT(vocab_size=64, seq_len=16, n_layer=3, n_embd=32, n_head=4, dropout=0.1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3, callbacks=[cb], **QUIET_TRAINER,
                        default_root_dir=sys.argv[1])
    trainer.fit(model, SyntheticTokens(vocab_size=64, seq_len=16, batch_size=2, num_batches=8))
    modes = {k: v.value for k, v in applied_policy(model).modes.items()}
    w = model.blocks[0].fc.weight.detach()
    gathered = trainer.strategy.all_gather(w)
    same = bool(torch.equal(gathered[0], gathered[1]))
    print(f"RANK{trainer.global_rank} modes={modes} records={len(cb.records)} in_sync={same}", flush=True)
    # Lightning leaves the gloo group up; tearing it down explicitly avoids gloo's occasional
    # "terminate called without an active exception" abort at interpreter exit.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_ddp_with_two_cpu_processes(tmp_path: Path) -> None:
    script = tmp_path / "ddp_run.py"
    script.write_text(DDP_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        check=False,  # the assertion below shows stderr, which check=True would not
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = "modes={'blocks.0': 'full', 'blocks.1': 'selective', 'blocks.2': 'none'} records=3 in_sync=True"
    assert f"RANK0 {expected}" in proc.stdout
    assert f"RANK1 {expected}" in proc.stdout
