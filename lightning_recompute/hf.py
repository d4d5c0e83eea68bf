"""`HFCausalLM`: a Hugging Face causal language model, built from a config (no download), as a LightningModule.

Batches are ``(input_ids, targets)`` pairs, as `lightning_recompute.reference.SyntheticTokens` yields.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

__all__ = ["HFCausalLM"]


class HFCausalLM(L.LightningModule):
    """A ``transformers`` causal LM built with ``AutoModelForCausalLM.from_config``.

    Args:
        model_type: the config's model type (``"llama"``, ``"gpt2"``, ``"qwen2"``, ...).
        config: the config's fields; anything left out keeps the model type's default.
        attn_implementation: ``"eager"``, ``"sdpa"`` or another implementation transformers knows.
        learning_rate: AdamW learning rate.
    """

    def __init__(
        self,
        model_type: str = "llama",
        config: dict[str, Any] | None = None,
        attn_implementation: str = "sdpa",
        learning_rate: float = 3e-4,
    ) -> None:
        super().__init__()
        import transformers

        self.save_hyperparameters()
        try:
            hf_config = transformers.AutoConfig.for_model(model_type, **(config or {}))
        except ValueError as err:
            raise ValueError(f"model_type: {err}") from None
        self.model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_implementation)
        self.learning_rate = learning_rate

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The next-token logits, ``(batch, seq, vocab)``."""
        return self.model(input_ids=input_ids).logits

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)
