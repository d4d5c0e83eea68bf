"""The recompute modes, declared once (without torch: policy files and the recipe schema read them); adding a
save-list family is one `ModeSpec` in `MODES` plus its line in ``tests/plugin/test_modes.py``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from lightning_recompute.errors import PolicyError, clip


class Mode(str, enum.Enum):
    """What a layer keeps between its forward and its backward."""

    NONE = "none"  # keep every activation, as PyTorch does without recomputation
    SELECTIVE = "selective"  # keep the outputs of expensive ops (matmuls, attention kernels), recompute the rest
    FULL = "full"  # keep only the layer's inputs; recompute the whole layer during backward
    OFFLOAD = "offload"  # keep every activation, in host memory until backward needs it (CUDA only)

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: Any, *, where: str) -> Mode:
        """The mode named by ``value``; a `PolicyError` naming ``where`` and the valid modes otherwise."""
        if isinstance(value, Mode):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        valid = ", ".join(m.value for m in cls)
        raise PolicyError(f"{where}: unknown mode {clip(repr(value))}; valid modes are: {valid}")


@dataclass(frozen=True)
class ModeSpec:
    """One mode a layer can take, as the policy file writes it, and what the code needs of it."""

    mode: Mode  # what runs it (SELECTIVE for every save-list family)
    family: str | None
    glyph: str  # one character for the mode in `RecomputePolicy.short`
    saving: int  # rank by memory saved per layer, 0 the least (the search space's order)
    recompute: int  # how much the mode recomputes (0 nothing); the race's tie-break prefers the least
    label: str  # the mode's column in the planner's table of plans
    save: tuple[str, ...] | None = None  # the ops whose outputs a selective mode keeps

    @property
    def name(self) -> str:
        """The mode as a policy file and a recipe write it: ``full``, ``selective:attn``, ..."""
        return self.mode.value if self.family is None else f"{self.mode.value}:{self.family}"

    @property
    def is_family(self) -> bool:
        return self.family is not None


ATTENTION_KERNELS: tuple[str, ...] = (
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._flash_attention_forward",
    "aten._efficient_attention_forward",
)
"""The fused attention kernels: every selective save list keeps their outputs."""

DEFAULT_SAVE_OPS: tuple[str, ...] = ("aten.mm", "aten.addmm", *ATTENTION_KERNELS)
"""What plain ``selective`` keeps; not ``aten.bmm`` (eager attention's scores, cheapest to recompute per byte)."""


def _attn_and(role: str) -> tuple[str, ...]:
    return (*ATTENTION_KERNELS, f"aten.mm:{role}", f"aten.addmm:{role}")


MODES: tuple[ModeSpec, ...] = (
    ModeSpec(Mode.NONE, None, glyph=".", saving=0, recompute=0, label="none"),
    ModeSpec(Mode.SELECTIVE, None, glyph="s", saving=1, recompute=2, label="sel", save=DEFAULT_SAVE_OPS),
    ModeSpec(Mode.FULL, None, glyph="F", saving=6, recompute=3, label="full"),
    # Offload recomputes nothing but frees more device memory than any selective mode.
    ModeSpec(Mode.OFFLOAD, None, glyph="o", saving=5, recompute=1, label="off"),
    # The save-list families (see docs/PLUGIN.md, 'Save-list families'); attn: only the attention kernels.
    ModeSpec(Mode.SELECTIVE, "attn", glyph="a", saving=4, recompute=2, label="attn", save=ATTENTION_KERNELS),
    # attn+wide: plus the widening GEMMs (fused QKV, MLP up/gate).
    ModeSpec(Mode.SELECTIVE, "attn+wide", glyph="w", saving=2, recompute=2, label="attn+wide", save=_attn_and("wide")),
    # attn+narrow: plus the narrowing GEMMs (the most FLOPs behind each byte kept).
    ModeSpec(
        Mode.SELECTIVE, "attn+narrow", glyph="n", saving=3, recompute=2, label="attn+narrow", save=_attn_and("narrow")
    ),
)
"""Every mode a layer can take, in canonical order (the planner breaks ties by it)."""

MODE_NAMES: tuple[str, ...] = tuple(s.name for s in MODES)

FAMILY_NAMES: tuple[str, ...] = tuple(s.family for s in MODES if s.family is not None)

SAVE_FAMILIES: dict[str, tuple[str, ...]] = {s.family: s.save or () for s in MODES if s.family is not None}
"""Named save lists a layer can take as ``selective:<name>``."""

BY_MEMORY_SAVED: tuple[str, ...] = tuple(s.name for s in sorted(MODES, key=lambda s: s.saving))
"""Every mode's name, the one that saves the least memory per layer first."""

UNKNOWN_GLYPH = "?"
