"""A recomputed layer's forward runs again in backward; the module state it changes must change once.

What a user relies on: after training with any policy, every parameter, every buffer of the
``state_dict`` (BatchNorm's statistics and counter, spectral norm's ``_u``/``_v``, a user's counters)
and the eval-mode output are bitwise equal to a run without recomputation; the bytes this costs are
counted; and Python-level state a replay changes again is reported, once, by layer.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import lightning as L
import pytest
import torch
from torch import nn

from lightning_recompute import RecomputeCallback, RecomputePolicy, apply_policy
from lightning_recompute.meter import StorageMeter
from lightning_recompute.replay import SideEffectWarning
from tests.plugin.stateful_models import KINDS, StatefulNet, differing, images, state

POLICIES = {
    "selective": RecomputePolicy.uniform("selective"),
    "full": RecomputePolicy.uniform("full"),
    "attn": RecomputePolicy.uniform("selective:attn"),
    "mixed": RecomputePolicy.from_modes({"blocks.0": "full", "blocks.1": "selective", "blocks.2": "none"}),
}


def _fit(make: Callable[..., L.Trainer], kind: str, policy: RecomputePolicy | None, **kw: object) -> StatefulNet:
    L.seed_everything(0, verbose=False)
    model = StatefulNet(kind)
    callbacks = [] if policy is None else [RecomputeCallback(policy)]
    make(max_steps=3, callbacks=callbacks, limit_val_batches=0, **kw).fit(model, images())
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_every_buffer_and_the_eval_output_equal_a_plain_run_in_every_mode(
    quiet_trainer: Callable[..., L.Trainer], kind: str
) -> None:
    plain = state(_fit(quiet_trainer, kind, None))
    for name, policy in POLICIES.items():
        trained = state(_fit(quiet_trainer, kind, policy))
        assert not differing(plain, trained), (kind, name, differing(plain, trained))
    if kind == "batchnorm":
        assert int(plain["blocks.0.bn1.num_batches_tracked"]) == 3  # counted once per step, not twice


def test_gradient_accumulation_updates_the_statistics_once_per_micro_batch(
    quiet_trainer: Callable[..., L.Trainer],
) -> None:
    plain = state(_fit(quiet_trainer, "batchnorm", None, accumulate_grad_batches=2))
    trained = state(_fit(quiet_trainer, "batchnorm", POLICIES["mixed"], accumulate_grad_batches=2))
    assert not differing(plain, trained)
    assert int(trained["blocks.1.bn2.num_batches_tracked"]) == 6


def test_a_second_backward_through_the_graph_replays_from_the_same_state() -> None:
    def train(policy: RecomputePolicy | None) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = StatefulNet("counter")
        if policy is not None:
            apply_policy(model, policy)
        x, y = next(iter(images()))
        loss = model.training_step((x, y), 0)
        loss.backward(retain_graph=True)
        loss.backward()  # retain_graph: full recomputation replays this layer a second time
        return {**state(model), **{f"grad {n}": p.grad for n, p in model.named_parameters()}}

    assert not differing(train(None), train(RecomputePolicy.uniform("full")))


def test_hugging_face_resnet_trains_its_batchnorm_statistics_as_without_recompute() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[2, 2], layer_type="basic", num_labels=5
    )

    def train(policy: RecomputePolicy | None) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = transformers.ResNetForImageClassification(config)
        if policy is not None:
            applied = apply_policy(model, policy)
            assert applied.layers == ["resnet.encoder.stages.0", "resnet.encoder.stages.1"]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in list(images(n=12, size=16))[:3]:
            model(pixel_values=x, labels=y).loss.backward()
            opt.step()
            opt.zero_grad()
        out = {k: v.clone() for k, v in model.state_dict().items()}
        model.eval()
        with torch.no_grad():
            out["eval logits"] = model(pixel_values=torch.ones(2, 3, 16, 16)).logits
        return out

    plain = train(None)
    for policy in ("full", "selective", {"resnet.encoder.stages.0": "full", "resnet.encoder.stages.1": "selective"}):
        p = RecomputePolicy.from_modes(policy) if isinstance(policy, dict) else RecomputePolicy.uniform(policy)
        assert not differing(plain, train(p)), policy


def test_the_copy_of_a_layers_buffers_is_on_the_ledger_until_backward() -> None:
    """A recomputed BatchNorm layer keeps its input (checkpoint's own) and a copy of its three buffers."""
    c, n = 16, 32

    def held(policy: str) -> int:
        torch.manual_seed(0)
        model = nn.Sequential(nn.BatchNorm1d(c), nn.BatchNorm1d(c))
        apply_policy(model, RecomputePolicy.uniform(policy), layers="*")
        x = torch.randn(n, c, requires_grad=True)
        with StorageMeter() as meter:
            meter.track(model, x)
            before = meter.current_bytes
            out = model(x)
            kept = meter.current_bytes - before
            out.sum().backward()
        return kept - out.untyped_storage().nbytes()

    # Per layer: running_mean and running_var (c float32 each) and num_batches_tracked (one int64); the
    # first layer's input is the caller's tensor, the second's the first's output.
    buffers = 2 * c * 4 + 8
    assert held("full") == 2 * buffers + n * c * 4


def test_python_state_a_replay_changes_again_is_reported_once_naming_the_layer() -> None:
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1  # a Python int: the replay increments it again
            return self.lin(x)

    model = nn.Sequential(Counting(), Counting())
    apply_policy(model, RecomputePolicy.from_modes({"0": "full", "1": "none"}), layers="*")
    with pytest.warns(SideEffectWarning, match=r"layer '0' .*reassigned 'calls'.*docs/PLUGIN.md") as record:
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
    assert len([w for w in record if issubclass(w.category, SideEffectWarning)]) == 1
    assert (model[0].calls, model[1].calls) == (4, 2)


def test_layers_that_change_no_python_state_warn_nothing(quiet_trainer: Callable[..., L.Trainer]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", SideEffectWarning)
        for kind in KINDS:
            _fit(quiet_trainer, kind, POLICIES["mixed"])


def test_a_replay_that_runs_out_of_memory_leaves_the_live_buffers_in_place() -> None:
    model = nn.Sequential(nn.BatchNorm1d(4), nn.BatchNorm1d(4))
    apply_policy(model, RecomputePolicy.uniform("full"), layers="*")
    out = model(torch.randn(8, 4, requires_grad=True))
    live = [(bn.running_mean, bn.running_mean.clone()) for bn in model]
    with StorageMeter(limit=1) as meter, pytest.raises(torch.OutOfMemoryError):
        meter.track(model)
        out.sum().backward()  # the replay's first copy of a buffer is over the cap
    for bn, (tensor, value) in zip(model, live, strict=True):
        assert bn.running_mean is tensor and torch.equal(tensor, value)
