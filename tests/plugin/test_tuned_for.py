"""The policy file's ``tuned_for`` section, and RecomputeCallback's check of the batch it trains at."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest

from lightning_recompute import (
    BatchSizeError,
    BatchSizeWarning,
    PolicyError,
    RecomputeCallback,
    RecomputePolicy,
    TunedFor,
)
from lightning_recompute.reference import ReferenceGPT, SyntheticTokens
from lightning_recompute.tuned_for import batch_advice

TINY = dict(vocab_size=64, seq_len=16, n_layer=2, n_embd=32, n_head=4, dropout=0.1)
TUNED = TunedFor(
    micro_batch=4,
    data_batch_size=8,
    peak_bytes=40_088_371,
    limit_bytes=47_815_065,
    device="cpu",
    recipe="quickstart",
    recipe_fingerprint="0123456789abcdef",
)
POLICY = RecomputePolicy.from_modes({"blocks.0": "none", "blocks.1": "full"})


def test_tuned_for_round_trips_through_yaml_and_json_and_leaves_the_fingerprint_alone(tmp_path: Path) -> None:
    tuned = POLICY.with_tuned_for(TUNED)
    for name in ("policy.yaml", "policy.json"):
        loaded = RecomputePolicy.load(tuned.save(tmp_path / name))
        assert loaded.tuned_for == TUNED
        assert loaded.to_dict()["tuned_for"]["micro_batch"] == 4
    # What the policy does is unchanged: same fingerprint, equal, same hash as without the record.
    assert tuned.fingerprint() == POLICY.fingerprint()
    assert tuned == POLICY and hash(tuned) == hash(POLICY)
    assert "tuned_for" not in POLICY.to_dict()
    assert POLICY.with_tuned_for(None).tuned_for is None
    assert "tuned for micro-batch 4 (data batch 8) on cpu: peak 38.23 MiB of limit 45.60 MiB" in tuned.describe()


def test_a_file_without_tuned_for_stays_valid(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("version: 1\nlayers:\n  blocks.*: full\n", encoding="utf-8")
    policy = RecomputePolicy.load(path)
    assert policy.tuned_for is None
    assert policy.fingerprint() == RecomputePolicy.uniform("full", "blocks.*").fingerprint()


@pytest.mark.parametrize(
    ("section", "pattern"),
    [
        ("{micro_batch: 0}", r"policy\.yaml: tuned_for\.micro_batch: expected a positive integer, got 0"),
        ("{micro_batch: four}", r"tuned_for\.micro_batch: expected a positive integer, got 'four'"),
        ("{batch: 4}", r"tuned_for: unknown key\(s\) \['batch'\]; valid keys are \['micro_batch', "),
        ("[4]", r"key 'tuned_for' must be a mapping with keys \['micro_batch', "),
        ("{device: 3}", r"tuned_for\.device: expected a string, got 3"),
    ],
)
def test_a_bad_tuned_for_names_the_file_and_key(tmp_path: Path, section: str, pattern: str) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(f"version: 1\nlayers: {{blocks.0: full}}\ntuned_for: {section}\n", encoding="utf-8")
    with pytest.raises(PolicyError, match=pattern):
        RecomputePolicy.load(path)


@pytest.mark.parametrize(
    ("micro_batch", "global_batch", "advice"),
    [(4, 8, (4, 2)), (5, 12, (4, 3)), (3, 7, (1, 7)), (16, 8, (8, 1)), (8, 8, (8, 1))],
)
def test_batch_advice_keeps_the_global_batch_exactly(
    micro_batch: int, global_batch: int, advice: tuple[int, int]
) -> None:
    size, steps = batch_advice(micro_batch, global_batch)
    assert (size, steps) == advice and size * steps == global_batch and size <= micro_batch


def _fit(
    make: Callable[..., L.Trainer], policy: Any, batch_size: int, **callback_kw: Any
) -> list[warnings.WarningMessage]:
    cb = RecomputeCallback(policy, measure_memory=False, **callback_kw)
    trainer = make(max_steps=2, callbacks=[cb])
    data = SyntheticTokens(vocab_size=64, seq_len=16, batch_size=batch_size, num_batches=4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(ReferenceGPT(**TINY), data)
    return [w for w in seen if issubclass(w.category, BatchSizeWarning)]


def test_training_at_a_larger_batch_warns_with_both_numbers_and_what_to_set(
    quiet_trainer: Callable[..., L.Trainer], tmp_path: Path
) -> None:
    path = POLICY.with_tuned_for(TUNED).save(tmp_path / "policy.yaml")
    caught = _fit(quiet_trainer, str(path), batch_size=8)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "tuned for micro-batch 4 (peak 38.23 MiB, limit 45.60 MiB on cpu)" in message
    assert "trains at batch size 8" in message
    assert "Set batch_size=4, accumulate_grad_batches=2 to keep the global batch of 8" in message


def test_training_at_or_under_the_tuned_batch_is_silent(
    quiet_trainer: Callable[..., L.Trainer], tmp_path: Path
) -> None:
    path = POLICY.with_tuned_for(TUNED).save(tmp_path / "policy.yaml")
    assert _fit(quiet_trainer, str(path), batch_size=4) == []
    assert _fit(quiet_trainer, str(path), batch_size=2, strict_batch_size=True) == []


def test_a_policy_without_tuned_for_trains_at_any_batch_without_a_warning(
    quiet_trainer: Callable[..., L.Trainer], tmp_path: Path
) -> None:
    assert _fit(quiet_trainer, POLICY.to_dict(), batch_size=8, strict_batch_size=True) == []


def test_strict_batch_size_raises_before_the_larger_batch_runs(
    quiet_trainer: Callable[..., L.Trainer], tmp_path: Path
) -> None:
    with pytest.raises(BatchSizeError, match=r"micro-batch 4 .* batch size 8.*batch_size=4, accumulate_grad_batches=2"):
        _fit(quiet_trainer, POLICY.with_tuned_for(TUNED), batch_size=8, strict_batch_size=True)


def test_a_larger_batch_later_in_the_epoch_warns_once_though_the_first_batch_is_small(
    quiet_trainer: Callable[..., L.Trainer],
) -> None:
    from tests.tuner.faulty import VaryingBatches

    # Batches of 1, 8, 2, 16 samples: only the first was checked, and it is the smallest.
    cb = RecomputeCallback(POLICY.with_tuned_for(TUNED), measure_memory=False)
    trainer = quiet_trainer(max_steps=4, callbacks=[cb])
    data = VaryingBatches(vocab_size=64, seq_len=16, num_batches=4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(ReferenceGPT(**TINY), data)
    caught = [w for w in seen if issubclass(w.category, BatchSizeWarning)]
    assert len(caught) == 1 and "trains at batch size 8" in str(caught[0].message)
