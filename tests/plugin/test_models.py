"""Models nobody here wrote: Hugging Face (Llama eager/sdpa with GQA, GPT-2, T5, BERT, ViT),
`torch.nn.TransformerEncoder` and Lightning's demo Transformer, under every recompute mode.

Each is built from a tiny config (no download) with its defaults left alone (``use_cache=True``
for the HF decoders) and dropout on. For each: what ``layers="auto"`` finds, ``state_dict`` keys
unchanged, the weights after two AdamW steps bitwise equal to no recomputation, and the exact
CPU storage ledger ordering the modes' peaks.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_recompute import (
    IncompatibleModelError,
    Mode,
    RecomputePolicy,
    StorageMeter,
    apply_policy,
    layer_names,
)

transformers = pytest.importorskip("transformers")

B, T, V = 2, 16, 64
MODES = ("none", "selective", "full", "offload", "mixed")


@dataclass(frozen=True)
class Zoo:
    """A model family: how to build it, feed it, take its loss, and where its layers are."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, int], dict[str, torch.Tensor]]
    loss: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
    layers: list[str]


def _tokens(g: torch.Generator, b: int = B) -> dict[str, torch.Tensor]:
    x = torch.randint(1, V, (b, T), generator=g)
    return {"input_ids": x, "labels": x}


def _seq2seq(g: torch.Generator, b: int = B) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(1, V, (b, T), generator=g), "labels": torch.randint(1, V, (b, T), generator=g)}


def _hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def _llama(attn: str) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=2 * T,
        attention_dropout=0.1,
    )
    config._attn_implementation = attn
    return transformers.LlamaForCausalLM(config)


def _gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=V, n_positions=2 * T, n_embd=32, n_layer=3, n_head=4, bos_token_id=0, eos_token_id=0
        )
    )


def _t5() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=V,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.1,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config)


def _bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=2 * T,
    )
    return transformers.BertForMaskedLM(config)


def _vit() -> nn.Module:
    config = transformers.ViTConfig(
        image_size=16,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=64,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        num_labels=4,
    )
    return transformers.ViTForImageClassification(config)


def _images(g: torch.Generator, b: int = B) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(b, 3, 16, 16, generator=g), "labels": torch.randint(0, 4, (b,), generator=g)}


class _TorchEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        self.embed = nn.Embedding(V, 32)
        self.encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.head = nn.Linear(32, V)


def _torch_encoder_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model.head(model.encoder(model.embed(batch["input_ids"])))
    return F.cross_entropy(out.flatten(0, 1), batch["labels"].flatten())


def _demo() -> nn.Module:
    from lightning.pytorch.demos import Transformer

    return Transformer(vocab_size=V, ninp=32, nhead=4, nhid=64, nlayers=2, dropout=0.1)


def _demo_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(batch["input_ids"], batch["labels"])
    return F.nll_loss(out, batch["labels"].view(-1))


def _stack(prefix: str, n: int) -> list[str]:
    return [f"{prefix}.{i}" for i in range(n)]


ZOO: dict[str, Zoo] = {
    "llama-eager": Zoo(lambda: _llama("eager"), _tokens, _hf_loss, _stack("model.layers", 3)),
    "llama-sdpa": Zoo(lambda: _llama("sdpa"), _tokens, _hf_loss, _stack("model.layers", 3)),
    "gpt2": Zoo(_gpt2, _tokens, _hf_loss, _stack("transformer.h", 3)),
    "t5": Zoo(_t5, _seq2seq, _hf_loss, _stack("encoder.block", 2) + _stack("decoder.block", 2)),
    "bert": Zoo(_bert, _tokens, _hf_loss, _stack("bert.encoder.layer", 3)),
    "vit": Zoo(_vit, _images, _hf_loss, _stack("vit.layers", 3)),
    "torch-encoder": Zoo(_TorchEncoder, _tokens, _torch_encoder_loss, _stack("encoder.layers", 3)),
    "lightning-demo": Zoo(
        _demo, _seq2seq, _demo_loss, _stack("transformer.encoder.layers", 2) + _stack("transformer.decoder.layers", 2)
    ),
}


def _policy(mode: str, layers: list[str]) -> RecomputePolicy:
    if mode != "mixed":
        return RecomputePolicy.uniform(mode)
    cycle = (Mode.FULL, Mode.SELECTIVE, Mode.NONE, Mode.OFFLOAD)
    return RecomputePolicy(layers=tuple((name, cycle[i % len(cycle)]) for i, name in enumerate(layers)))


def _base(name: str) -> nn.Module:
    torch.manual_seed(0)
    return ZOO[name].build()


def _train_two_steps(name: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """Two AdamW steps with dropout on; the parameters after them."""
    zoo = ZOO[name]
    g = torch.Generator().manual_seed(1)
    batches = [zoo.batch(g, B) for _ in range(2)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    torch.manual_seed(1234)  # the dropout stream: identical for every policy
    for batch in batches:
        opt.zero_grad()
        zoo.loss(model, batch).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


_REFERENCE: dict[str, dict[str, torch.Tensor]] = {}


def _reference(name: str) -> dict[str, torch.Tensor]:
    if name not in _REFERENCE:
        _REFERENCE[name] = _train_two_steps(name, _base(name))
    return _REFERENCE[name]


@pytest.mark.parametrize("name", list(ZOO))
def test_auto_discovery_finds_every_block_stack(name: str) -> None:
    assert layer_names(_base(name)) == ZOO[name].layers


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(ZOO))
def test_weights_after_two_adamw_steps_bitwise_equal_to_no_recompute(name: str, mode: str) -> None:
    model = _base(name)
    keys = list(model.state_dict())
    applied = apply_policy(model, _policy(mode, ZOO[name].layers))
    assert applied.layers == ZOO[name].layers
    assert list(model.state_dict()) == keys
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # offload on CPU, the KV-cache notice
        weights = _train_two_steps(name, model)
    reference = _reference(name)
    assert weights.keys() == reference.keys()
    for key, value in weights.items():
        assert torch.equal(value, reference[key]), key


def _peak(name: str, mode: str) -> int:
    model = _base(name)
    apply_policy(model, RecomputePolicy.uniform(mode))
    model.train()
    # 8 samples: the demo Transformer builds a (5000, 1, 32) positional table in every forward, which
    # at 2 samples of 16 tokens outweighs every activation recomputation could drop.
    batch = ZOO[name].batch(torch.Generator().manual_seed(1), 8)
    meter = StorageMeter()
    meter.track(model, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with meter:
            meter.reset_peak()
            ZOO[name].loss(model, batch).backward()
    peak = meter.peak_bytes
    meter.close()
    return peak


@pytest.mark.parametrize("name", list(ZOO))
def test_peak_memory_orders_the_modes(name: str) -> None:
    peaks = {mode: _peak(name, mode) for mode in ("none", "selective", "full")}
    assert peaks["none"] > peaks["selective"] >= peaks["full"], peaks


# ---------------------------------------------------------------------- the KV cache

DECODERS = ["llama-eager", "llama-sdpa", "gpt2", "t5"]


def _cache_lengths(output: Any, n_layers: int) -> list[int]:
    cache = output.past_key_values
    if isinstance(cache, transformers.EncoderDecoderCache):
        cache = cache.self_attention_cache
    return [cache.get_seq_length(i) for i in range(n_layers)]


@pytest.mark.parametrize("name", DECODERS)
def test_training_with_the_cache_on_writes_each_layer_once(name: str) -> None:
    zoo = ZOO[name]
    model = _base(name)
    decoder = [n for n in zoo.layers if not n.startswith("encoder.")]
    apply_policy(model, RecomputePolicy.from_modes(dict(zip(decoder, ("full", "none", "selective"), strict=False))))
    batch = zoo.batch(torch.Generator().manual_seed(1), B)
    model.train()
    output = model(**batch, use_cache=True)
    assert _cache_lengths(output, len(decoder)) == [T] * len(decoder)
    output.loss.backward()  # replays the full and selective layers
    # The replays wrote nothing: every layer, recomputed or not, holds its T positions once.
    assert _cache_lengths(output, len(decoder)) == [T] * len(decoder)


@pytest.mark.parametrize("name", DECODERS)
def test_without_grad_the_cache_works_under_any_policy(name: str) -> None:
    zoo = ZOO[name]
    model = _base(name)
    plain = copy.deepcopy(model)
    apply_policy(model, RecomputePolicy.uniform("full"))
    batch = zoo.batch(torch.Generator().manual_seed(1), B)
    decoder = [n for n in zoo.layers if not n.startswith("encoder.")]
    for m in (model, plain):
        m.eval()
    with torch.no_grad():
        output = model(**batch, use_cache=True)
        expected = plain(**batch, use_cache=True)
    assert _cache_lengths(output, len(decoder)) == [T] * len(decoder)
    assert torch.equal(output.logits, expected.logits)


@pytest.mark.parametrize("enable", ["gradient_checkpointing_enable", "activation_checkpointing_enable"])
def test_hf_checkpointing_enabled_is_still_refused(enable: str) -> None:
    model = _base("llama-sdpa")
    if not hasattr(model, enable):
        pytest.skip(f"transformers {transformers.__version__} has no {enable}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames gradient_ to activation_checkpointing
        getattr(model, enable)()
    with pytest.raises(IncompatibleModelError, match=r"gradient_checkpointing enabled \(Hugging Face style\)"):
        apply_policy(model, RecomputePolicy.uniform("full"))
