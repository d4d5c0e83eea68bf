"""`HFCausalLM`: a Hugging Face causal language model, built from a config (no download), as a LightningModule.

Batches are ``(input_ids, targets)`` pairs, as `lightning_recompute.reference.SyntheticTokens` yields.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lightning_recompute.reference import TokenLM


class HFCausalLM(TokenLM):
    """A ``transformers`` causal LM built with ``AutoModelForCausalLM.from_config`` from ``model_type``
    (``"llama"``, ``"gpt2"``, ...) and the ``config`` fields given (the model type's defaults for the rest).
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

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The next-token logits, ``(batch, seq, vocab)``."""
        return self.model(input_ids=input_ids).logits

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
