"""`TunedFor`: what a policy was tuned for (the policy file's ``tuned_for:``), which `RecomputeCallback` compares
with the training batches: a policy fits its budget only at the micro-batch it was measured at.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from lightning_recompute.errors import PolicyError, clip


@dataclass(frozen=True)
class TunedFor:
    """The conditions a policy was tuned under (the policy file's ``tuned_for:`` section)."""

    micro_batch: int | None = None  # samples per training batch, per device
    data_batch_size: int | None = None  # the global batch a job at micro_batch keeps by accumulation
    peak_bytes: int | None = None  # of the run the policy was promoted on
    limit_bytes: int | None = None  # the budget less its margin
    device: str | None = None
    recipe: str | None = None
    recipe_fingerprint: str | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.type == "int | None" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise PolicyError(f"tuned_for.{f.name}: expected a positive integer, got {clip(repr(value))}")
            if f.type == "str | None" and not isinstance(value, str):
                raise PolicyError(f"tuned_for.{f.name}: expected a string, got {clip(repr(value))}")

    @classmethod
    def from_dict(cls, data: Any) -> TunedFor:
        """Parse the ``tuned_for:`` mapping; errors name the key and the valid keys."""
        valid = [f.name for f in fields(cls)]
        if not isinstance(data, Mapping):
            raise PolicyError(f"key 'tuned_for' must be a mapping with keys {valid}, got {type(data).__name__}")
        unknown = [k for k in data if k not in valid]
        if unknown:
            raise PolicyError(f"tuned_for: unknown key(s) {clip(repr(unknown))}; valid keys are {valid}")
        return cls(**{str(k): v for k, v in data.items()})

    def to_dict(self) -> dict[str, Any]:
        """The ``tuned_for:`` mapping; keys without a value are left out."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def figures(self) -> str:
        """``peak 38.23 MiB, limit 45.60 MiB``: what was measured, as much as was recorded."""
        pairs = (("peak", self.peak_bytes), ("limit", self.limit_bytes))
        return ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in pairs if v)

    def describe(self) -> str:
        """One line: ``tuned for micro-batch 4 (data batch 8) on cpu: peak 38.23 MiB of limit 45.60 MiB ...``."""
        text = f"tuned for micro-batch {self.micro_batch if self.micro_batch is not None else 'not recorded'}"
        if self.data_batch_size is not None:
            text += f" (data batch {self.data_batch_size})"
        if self.device:
            text += f" on {self.device}"
        if self.peak_bytes is not None or self.limit_bytes is not None:
            text += f": {self.figures().replace(', limit', ' of limit')}"
        if self.recipe:
            text += f"; recipe {self.recipe}" + (f" ({self.recipe_fingerprint})" if self.recipe_fingerprint else "")
        return text


def batch_advice(micro_batch: int, global_batch: int) -> tuple[int, int]:
    """``(batch_size, accumulate_grad_batches)`` keeping ``global_batch`` samples per optimizer step in batches of
    at most ``micro_batch``: the largest divisor not above it (12 at 5: ``(4, 3)``)."""
    if micro_batch < 1 or global_batch < 1:
        raise ValueError(f"batch sizes must be positive, got micro_batch={micro_batch}, global_batch={global_batch}")
    size = max(d for d in range(1, min(micro_batch, global_batch) + 1) if global_batch % d == 0)
    return size, global_batch // size
