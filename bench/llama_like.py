"""A small, configurable Llama-style decoder for planning and tests.

`LlamaLike` has what matters for activation memory in decoder LLMs: pre-norm RMSNorm blocks,
grouped-query attention, optional rotary embeddings, a SwiGLU MLP, untied embeddings and an LM head;
its blocks are ``layers.N``. Built on the meta device it costs no memory at any size (`llama_7b`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "LlamaLike", "llama_7b", "token_batch"]


@dataclass(frozen=True)
class LlamaConfig:
    """Dimensions of a `LlamaLike` model: ``n_kv_heads`` ``None`` is multi-head attention, ``ffn_dim`` ``None``
    Llama's rule (2/3 of 4*dim, rounded up to a multiple of 256); ``rope`` off gives no position information."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    max_seq_len: int = 4096
    rope: bool = True
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim: {self.dim} is not divisible by n_heads={self.n_heads}")
        kv = self.kv_heads
        if not isinstance(kv, int) or kv < 1 or self.n_heads % kv:
            raise ValueError(f"n_kv_heads: must be a positive divisor of n_heads={self.n_heads}, got {kv!r}")
        if self.rope and (self.dim // self.n_heads) % 2:
            raise ValueError(f"rope: the head dimension {self.dim // self.n_heads} must be even")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden(self) -> int:
        return self.ffn_dim if self.ffn_dim is not None else 256 * ((int(2 * 4 * self.dim / 3) + 255) // 256)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (no mean subtraction, no bias), computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Half-split rotary embedding (GPT-NeoX / HF Llama layout): no complex numbers, works on meta.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        if rope is not None:
            cos, sin = rope
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.n_kv != self.n_heads:
            rep = self.n_heads // self.n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if x.device.type == "meta":
            # SDPA on meta falls back to the math path, which holds the full score matrix no fused GPU
            # kernel holds: call the flash kernel (it has a meta implementation) to model what a GPU runs.
            y = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """Pre-norm decoder block: attention and SwiGLU MLP, each behind an RMSNorm and a residual."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.hidden)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaLike(nn.Module):
    """A Llama-style decoder: ``tok_embeddings`` -> ``layers.N`` -> ``norm`` -> ``output``.

    ``forward(idx)`` returns logits; ``loss((idx, targets))`` the mean next-token cross-entropy (what
    `lightning_recompute.profile.profile_model` calls for a plain module).
    """

    def __init__(self, cfg: LlamaConfig | None = None, **overrides: Any) -> None:
        super().__init__()
        self.cfg = cfg = replace(cfg or LlamaConfig(), **overrides)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def _rope(self, t: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.cfg.rope:
            return None
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.cfg.max_seq_len}")
        half = (self.cfg.dim // self.cfg.n_heads) // 2
        # Per call, not a buffer: a buffer would need materialising when the model is built on meta.
        inv = 1.0 / (10000.0 ** (torch.arange(half, device=device, dtype=torch.float32) / half))
        ang = torch.outer(torch.arange(t, device=device, dtype=torch.float32), inv)
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(idx)
        rope = self._rope(idx.size(1), h.device, h.dtype)
        for layer in self.layers:
            h = layer(h, rope)
        return self.output(self.norm(h))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        idx, targets = batch
        logits = self(idx)
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


def llama_7b(**overrides: Any) -> LlamaConfig:
    """Llama-2-7B's dimensions (32 layers, width 4096, 32 heads, SwiGLU 11008, vocab 32000)."""
    base = LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, max_seq_len=4096)
    return replace(base, **overrides)


def token_batch(
    batch_size: int, seq_len: int, vocab_size: int, device: torch.device | str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``(input ids, next-token targets)`` pair of shape ``(batch_size, seq_len)``; no data on meta."""
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size!r}, {seq_len!r}")
    dev = torch.device(device)
    if dev.type == "meta":
        x = torch.empty(batch_size, seq_len, dtype=torch.long, device=dev)
        return x, torch.empty_like(x)
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=g).to(dev)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()
