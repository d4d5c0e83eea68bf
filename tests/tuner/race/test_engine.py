"""`lightning_recompute.race.schedule.race`: a race in one Lightning fit, with a patched step clock and a seeded load.

The timer is the only thing faked: the model trains for real (policies switched between steps,
memory metered by the CPU ledger), and each step "takes" its policy's base time times the load of
a seeded noisy neighbour at that moment, so every verdict is exact and repeatable.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from bench.neighbour import LoadModel
from lightning_recompute import RecomputePolicy, applied_policy
from lightning_recompute.race import RacePlan
from lightning_recompute.race.schedule import race
from lightning_recompute.reference import ReferenceGPT, SyntheticTokens

NAMES = [f"blocks.{i}" for i in range(3)]
NONE = RecomputePolicy.uniform("none")
FULL = RecomputePolicy.uniform("full")
ONE = RecomputePolicy.first_n(NAMES, 1, "full")
TWO = RecomputePolicy.first_n(NAMES, 2, "full")
TINY = dict(vocab_size=64, seq_len=16, n_layer=3, n_embd=32, n_head=4, dropout=0.1)
DATA = dict(vocab_size=64, seq_len=16, batch_size=4, num_batches=8)


class _Clock:
    """What each step costs: its policy's base time times the load when it starts."""

    def __init__(self, base: dict[str, float], load: LoadModel) -> None:
        self.base, self.load, self.now = base, load, 0.0
        self.model: torch.nn.Module | None = None
        self.order: list[str] = []

    def timer(self, device: Any = "cpu") -> Any:
        clock = self

        class Timer:
            def start(self) -> None:
                pass

            def stop(self) -> float:
                assert clock.model is not None
                applied = applied_policy(clock.model)
                key = applied.policy.fingerprint() if applied is not None else NONE.fingerprint()
                clock.order.append(key)
                seconds = clock.base[key] * clock.load.factor(clock.now)
                clock.now += seconds
                return seconds

        return Timer()


def _race(monkeypatch: pytest.MonkeyPatch, base: dict[RecomputePolicy, float], **kw: Any) -> tuple[dict, _Clock, Any]:
    clock = _Clock({p.fingerprint(): t for p, t in base.items()}, LoadModel(seed=1, busy_s=5.0, idle_s=5.0))
    monkeypatch.setattr("lightning_recompute.callback.StepTimer", clock.timer)
    L.seed_everything(0, verbose=False)
    model = ReferenceGPT(**TINY)
    clock.model = model
    entrants = [(p.fingerprint(), p, p.short(NAMES)) for p in base]
    plan = kw.pop("plan", RacePlan(min_rounds=6, max_rounds=12, time_s=1e9, estimate_rounds=8, warmup_steps=1))
    out = race(model, SyntheticTokens(**DATA), entrants, plan=plan, **kw)
    return out, clock, model


def test_a_faster_policy_wins_with_confidence_and_the_figures_are_interleaved(monkeypatch: pytest.MonkeyPatch) -> None:
    out, clock, _ = _race(monkeypatch, {FULL: 0.13, ONE: 0.10, TWO: 0.115}, references=[FULL.fingerprint()])
    assert out["leader"] == out["winner"] == ONE.fingerprint() and out["tied"] == [ONE.fingerprint()]
    assert out["stop"].startswith("leader separated from every other entrant at 99%")
    assert 8 <= out["select_rounds"] < 12  # 99% needs 8 rounds of order statistics; it stops as soon as it may
    vs = out["vs"][FULL.fingerprint()]
    assert vs["low"] <= 1.3 <= vs["high"] and vs["ratio"] == pytest.approx(1.3, rel=0.01)
    assert out["estimate_rounds"] == 8
    # Rotation: each round starts one place later (settle + 2 timed steps per turn).
    first_round = clock.order[1 : 1 + 9 : 3]
    second_round = clock.order[10 : 10 + 9 : 3]
    assert first_round == [FULL.fingerprint(), ONE.fingerprint(), TWO.fingerprint()]
    assert second_round == [ONE.fingerprint(), TWO.fingerprint(), FULL.fingerprint()]


def test_identical_policies_tie_and_the_tie_goes_to_the_most_headroom(monkeypatch: pytest.MonkeyPatch) -> None:
    # An A/A race: three policies the clock makes exactly as fast, under the same load.
    out, _, _ = _race(monkeypatch, {NONE: 0.1, ONE: 0.1, FULL: 0.1})
    assert sorted(out["tied"]) == sorted(p.fingerprint() for p in (NONE, ONE, FULL))
    assert out["stop"] == "12 rounds (the most allowed)"
    peaks = {k: e["peak_bytes"] for k, e in out["entrants"].items()}
    assert out["winner"] == FULL.fingerprint() == min(peaks, key=peaks.__getitem__)


def test_an_entrant_over_the_limit_is_out_at_once_and_never_runs_again(monkeypatch: pytest.MonkeyPatch) -> None:
    probe, _, _ = _race(monkeypatch, {NONE: 0.1, FULL: 0.12}, plan=RacePlan(min_rounds=2, max_rounds=2, warmup_steps=1))
    peaks = {k: e["peak_bytes"] for k, e in probe["entrants"].items()}
    limit = (peaks[NONE.fingerprint()] + peaks[FULL.fingerprint()]) // 2
    out, clock, _ = _race(monkeypatch, {NONE: 0.1, FULL: 0.12, ONE: 0.11}, budget_bytes=limit)
    none = out["entrants"][NONE.fingerprint()]
    assert none["out"] is not None and "over the limit" in none["out"]
    assert clock.order.count(NONE.fingerprint()) == 2  # its warm-up step and the metered step that put it out
    assert out["winner"] == ONE.fingerprint()


def test_every_race_step_is_a_training_step(monkeypatch: pytest.MonkeyPatch, quiet_trainer: Any) -> None:
    _, clock, raced = _race(
        monkeypatch,
        {FULL: 0.13, ONE: 0.10},
        plan=RacePlan(min_rounds=2, max_rounds=3, estimate_rounds=2, warmup_steps=1),
    )
    steps = len(clock.order)
    L.seed_everything(0, verbose=False)
    plain = ReferenceGPT(**TINY)
    quiet_trainer(max_steps=steps, limit_val_batches=0).fit(plain, SyntheticTokens(**DATA))
    for (name, p), q in zip(raced.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_an_entrant_beaten_with_confidence_stops_costing_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    out, clock, _ = _race(monkeypatch, {ONE: 0.10, TWO: 0.10, FULL: 0.2})
    full = out["entrants"][FULL.fingerprint()]
    assert full["dropped"] is not None and full["dropped"].startswith("beaten by F.. at 99% after")
    ran = [t for t in full["select_s"] if t is not None]
    assert len(ran) < out["select_rounds"] == 12  # dropped early; the tied two raced on
    assert clock.order.count(FULL.fingerprint()) < clock.order.count(ONE.fingerprint())
    assert sorted(out["tied"]) == sorted([ONE.fingerprint(), TWO.fingerprint()])
