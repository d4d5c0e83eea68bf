"""A GPT-style reference model (``attention="eager"`` materialises the seq x seq matrix) and synthetic tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, n_head: int, dropout: float, attention: str) -> None:
        super().__init__()
        if width % n_head:
            raise ValueError(f"n_embd/widths: width {width} is not divisible by n_head={n_head}")
        self.n_head = n_head
        self.attention = attention
        self.dropout = dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        if self.attention == "sdpa" and x.device.type == "meta":
            # On meta SDPA falls back to the math path (a seq x seq matrix); the flash kernel is what a GPU runs.
            y = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, p, True)[0]
        elif self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf"))
            att = self.attn_drop(F.softmax(att, dim=-1))
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """Pre-norm transformer block; ``out_width`` != ``width`` adds a projection to the next width."""

    def __init__(self, width: int, n_head: int, dropout: float, attention: str, mlp_ratio: int, out_width: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, n_head, dropout, attention)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, mlp_ratio * width)
        self.fc_out = nn.Linear(mlp_ratio * width, width)
        self.mlp_drop = nn.Dropout(dropout)
        self.resize = nn.Linear(width, out_width) if out_width != width else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp_drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))
        return x if self.resize is None else self.resize(x)


class TokenLM(L.LightningModule):
    """Next-token prediction on ``(input_ids, targets)`` batches, with AdamW at ``hparams.learning_rate``."""

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["learning_rate"])


class ReferenceGPT(TokenLM):
    """A small GPT; its blocks live at ``blocks.0`` ... ``blocks.{n_layer-1}``, of width ``n_embd``, or one
    block per entry of ``widths`` (a heterogeneous stack). ``dropout`` applies to embeddings, attention and
    residuals; ``mlp_ratio`` is the MLP's hidden width over the block's.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 64,
        n_layer: int = 4,
        n_embd: int = 64,
        n_head: int = 4,
        dropout: float = 0.1,
        attention: Literal["eager", "sdpa"] = "eager",
        mlp_ratio: int = 4,
        widths: Sequence[int] | None = None,
        learning_rate: float = 3e-4,
    ) -> None:
        super().__init__()
        if attention not in ("eager", "sdpa"):
            raise ValueError(f"attention: {attention!r} is not valid; choose 'eager' or 'sdpa'")
        self.save_hyperparameters()
        ws = list(widths) if widths else [n_embd] * n_layer
        self.tok_emb = nn.Embedding(vocab_size, ws[0])
        self.pos_emb = nn.Embedding(seq_len, ws[0])
        self.drop = nn.Dropout(dropout)
        outs = [*ws[1:], ws[-1]]
        self.blocks = nn.ModuleList(
            Block(w, n_head, dropout, attention, mlp_ratio, o) for w, o in zip(ws, outs, strict=True)
        )
        self.ln_f = nn.LayerNorm(ws[-1])
        self.head = nn.Linear(ws[-1], vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class ShardedGPT(ReferenceGPT):
    """`ReferenceGPT` for ``ModelParallelStrategy``: ``configure_model`` ``fully_shard``s each block, then the model.

    The blocks exist from ``__init__``, so `RecomputeCallback` applies its policy before the sharding.
    """

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        data_parallel = mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=data_parallel)
        fully_shard(self, mesh=data_parallel)


class SyntheticTokens(L.LightningDataModule):
    """``num_batches`` batches of ``(input, next-token target)``, each ``(batch_size, seq_len)``, of token ids in
    ``[0, vocab_size)`` drawn from ``seed`` (the validation data from ``seed + 1``).
    """

    def __init__(
        self, vocab_size: int = 256, seq_len: int = 64, batch_size: int = 8, num_batches: int = 16, seed: int = 0
    ) -> None:
        super().__init__()
        self.vocab_size, self.seq_len, self.batch_size = vocab_size, seq_len, batch_size
        self.num_batches, self.seed = num_batches, seed

    def _loader(self, seed: int) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        rows = torch.randint(0, self.vocab_size, (self.batch_size * self.num_batches, self.seq_len + 1), generator=g)
        return DataLoader(TensorDataset(rows[:, :-1], rows[:, 1:]), batch_size=self.batch_size, shuffle=False)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.seed)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.seed + 1)
