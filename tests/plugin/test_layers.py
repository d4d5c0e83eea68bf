"""Finding the repeated blocks of a model, named by module path."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_recompute import LayerDiscoveryError, find_layers, layer_names
from lightning_recompute.reference import Block, ReferenceGPT


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.heads = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


class _HF(nn.Module):
    """Hugging Face style nesting: model.layers / transformer.h / encoder.layer."""

    def __init__(self, outer: str, inner: str, n: int) -> None:
        super().__init__()
        body = nn.Module()
        setattr(body, inner, nn.ModuleList(_Layer() for _ in range(n)))
        body.norm = nn.LayerNorm(4)
        setattr(self, outer, body)
        self.lm_head = nn.Linear(4, 4)


@pytest.mark.parametrize(("outer", "inner"), [("model", "layers"), ("transformer", "h"), ("encoder", "layer")])
def test_auto_finds_the_longest_same_class_stack(outer: str, inner: str) -> None:
    assert layer_names(_HF(outer, inner, 3)) == [f"{outer}.{inner}.{i}" for i in range(3)]


def test_auto_on_reference_model_and_sequential() -> None:
    assert layer_names(ReferenceGPT(n_layer=3)) == ["blocks.0", "blocks.1", "blocks.2"]
    seq = nn.Sequential(*(Block(8, 2, 0.0, "eager", 2, 8) for _ in range(2)))
    assert layer_names(seq) == ["0", "1"]


def test_auto_ignores_mixed_class_containers() -> None:
    model = nn.Module()
    model.mixed = nn.ModuleList([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)])
    model.stack = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
    assert layer_names(model) == ["stack.0", "stack.1"]


def test_explicit_paths_globs_classes_keep_outermost_only() -> None:
    model = _HF("model", "layers", 3)
    assert layer_names(model, "model.layers.*") == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert layer_names(model, ["model.layers.0", "model.layers.2"]) == ["model.layers.0", "model.layers.2"]
    assert layer_names(model, _Layer) == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert layer_names(model, "class:_Layer") == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert [p for p, _ in find_layers(model, "lm_head")] == ["lm_head"]


def test_no_repeated_blocks_is_a_clear_error() -> None:
    with pytest.raises(LayerDiscoveryError, match=r"layers='auto': no repeated blocks found in Linear"):
        find_layers(nn.Linear(2, 2))


def test_unmatched_explicit_selection_names_it() -> None:
    with pytest.raises(
        LayerDiscoveryError,
        match=r"\['decoder\.\*'\] match no module of _HF; candidate module paths include: model, model\.layers",
    ):
        find_layers(_HF("model", "layers", 2), ["model.layers.*", "decoder.*"])
