"""The recompute modes, declared once: every mode a layer can take and what the code needs of each.

`MODES` has one `ModeSpec` per mode a policy file can name: the four plugin modes (`Mode`) and a
``selective:<family>`` entry per named save list. Each says how the mode is written, its glyph
(one character of `RecomputePolicy.short`), how much memory it saves relative to the others (the
order the tuner's search space gives modes), how much it recomputes (the weight the race's
tie-break gives it), and, for the selective ones, the ops whose outputs it keeps. Everything else
that needs the vocabulary reads it from here: `Mode` parsing and the glyphs (`policy`), the save
lists (`selective`), the recipe schema's choice of modes, the search space's order, the race's
recompute strength, the planner's table, the profile's modes and the benchmarks.

**Adding a save-list family is one `ModeSpec` in `MODES`** (name, glyph, ranks, save list) plus
its line in ``tests/plugin/test_modes.py``. A new plugin mode also needs a `Mode` member and the
code that applies it (`lightning_recompute.apply`).

Why a module of its own: the vocabulary must load without torch (policy files, the recipe's JSON
Schema and the tuner's ``schema`` and ``plan`` commands read it), so it cannot live in
`lightning_recompute.selective`, which imports torch to resolve op names; and `policy` is about
layer -> mode maps and their files, which are one user of the vocabulary among many. This module
imports nothing but `lightning_recompute.errors`, so anything may import it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from lightning_recompute.errors import PolicyError, clip

__all__ = [
    "ATTENTION_KERNELS",
    "BY_MEMORY_SAVED",
    "DEFAULT_SAVE_OPS",
    "FAMILY_NAMES",
    "MODES",
    "MODE_NAMES",
    "SAVE_FAMILIES",
    "UNKNOWN_GLYPH",
    "Mode",
    "ModeSpec",
    "spec",
]


class Mode(str, enum.Enum):
    """What a layer keeps between its forward and its backward."""

    NONE = "none"
    """Keep every activation (what PyTorch does without recomputation)."""
    SELECTIVE = "selective"
    """Keep the outputs of expensive ops (matmuls, attention kernels); recompute the cheap ones."""
    FULL = "full"
    """Keep only the layer's inputs; recompute the whole layer during backward."""
    OFFLOAD = "offload"
    """Keep every activation, but in host memory until backward needs it (CUDA only)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse_choice(cls, value: Any, *, where: str) -> tuple[Mode, str | None]:
        """A layer's mode and save-list family from ``"selective:<family>"`` or a plain mode (family ``None``).

        The family's name is checked against `SAVE_FAMILIES` by `RecomputePolicy`.
        """
        if isinstance(value, str) and ":" in value:
            base, _, family = value.strip().partition(":")
            mode = cls.parse(base, where=where)
            if mode is not Mode.SELECTIVE or not family.strip():
                raise PolicyError(
                    f"{where}: {clip(repr(value))}: only selective takes a save-list family, written "
                    f"selective:<family> (e.g. selective:attn)"
                )
            return mode, family.strip()
        return cls.parse(value, where=where), None

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

    mode: Mode
    """The plugin mode that runs it (`Mode.SELECTIVE` for every save-list family)."""
    family: str | None
    """The save-list family (written ``selective:<family>``), or ``None`` for a plain mode."""
    glyph: str
    """One character for the mode in `RecomputePolicy.short` (logs, tables, the race's tie-break)."""
    saving: int
    """Rank by memory saved per layer, 0 the least. The tuner's search space orders modes by it: the
    weakest mode searched fills the layers no count claims, the strongest is placed first."""
    recompute: int
    """How much the mode recomputes (0 nothing; full recomputes most): the race's tie-break prefers
    the least (`lightning_recompute.race.rule.recompute_strength`)."""
    label: str
    """The mode's column name in the planner's table of plans (``sel`` for selective)."""
    save: tuple[str, ...] | None = None
    """The ops whose outputs a selective mode keeps (plain selective: `DEFAULT_SAVE_OPS`, which a
    policy's ``selective.save`` replaces); ``None`` for the modes that are not selective."""

    @property
    def name(self) -> str:
        """The mode as a policy file and a recipe write it: ``full``, ``selective:attn``, ..."""
        return self.mode.value if self.family is None else f"{self.mode.value}:{self.family}"

    @property
    def is_family(self) -> bool:
        """Whether the mode is selective recomputation with a named save list (``selective:<family>``)."""
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
"""What plain ``selective`` keeps: matmuls against weights and fused attention kernels. ``aten.bmm``
is deliberately absent: in eager attention it produces the (batch, heads, seq, seq) score and
context tensors, which are the cheapest to recompute per byte kept."""


MODES: tuple[ModeSpec, ...] = (
    ModeSpec(Mode.NONE, None, glyph=".", saving=0, recompute=0, label="none"),
    ModeSpec(Mode.SELECTIVE, None, glyph="s", saving=1, recompute=2, label="sel", save=DEFAULT_SAVE_OPS),
    ModeSpec(Mode.FULL, None, glyph="F", saving=6, recompute=3, label="full"),
    # Offload recomputes nothing (it moves activations to host memory and back), but frees more
    # device memory than any selective mode.
    ModeSpec(Mode.OFFLOAD, None, glyph="o", saving=5, recompute=1, label="off"),
    # The save-list families: which ops are worth keeping depends on shapes, so the tuner profiles
    # each family per layer and lets its planner choose. A matmul entry qualified ``:wide`` (output
    # wider than input: fused QKV, MLP up/gate) or ``:narrow`` (the others: attention output and
    # MLP down projections, separate q/k/v) keeps only those GEMMs
    # (`lightning_recompute.selective.MATMUL_ROLES`). In eager attention (the score matmul is
    # an ``aten.bmm``) no family keeps the (seq x seq) scores; there ``attn`` keeps nothing of
    # attention, and the profile shows what each family is worth.
    #
    # attn: only the fused attention kernels' outputs; every GEMM, norm and activation is
    # recomputed. The least memory selective recomputation keeps, for the price of re-running the
    # layer's GEMMs; pays off at long sequence, where attention is the expensive part to recompute.
    ModeSpec(Mode.SELECTIVE, "attn", glyph="a", saving=4, recompute=2, label="attn", save=ATTENTION_KERNELS),
    # attn+wide: plus the widening GEMMs: keeps what attention and the activation function consume,
    # recomputes the output and down projections (the GEMMs whose outputs are the narrow ones).
    ModeSpec(
        Mode.SELECTIVE,
        "attn+wide",
        glyph="w",
        saving=2,
        recompute=2,
        label="attn+wide",
        save=(*ATTENTION_KERNELS, "aten.mm:wide", "aten.addmm:wide"),
    ),
    # attn+narrow: plus the narrowing GEMMs: the outputs with the most FLOPs behind each byte kept;
    # recomputes the wide GEMMs.
    ModeSpec(
        Mode.SELECTIVE,
        "attn+narrow",
        glyph="n",
        saving=3,
        recompute=2,
        label="attn+narrow",
        save=(*ATTENTION_KERNELS, "aten.mm:narrow", "aten.addmm:narrow"),
    ),
)
"""Every mode a layer can take, in canonical order: the plugin modes in `Mode`'s order, then the
save-list families. The order is the recipe schema's, the profile's and the planner's (which breaks
ties by it)."""

# ---------------------------------------------------------------------- views of MODES

MODE_NAMES: tuple[str, ...] = tuple(s.name for s in MODES)
"""Every mode as a policy file and a recipe write it, in `MODES`' order."""

FAMILY_NAMES: tuple[str, ...] = tuple(s.family for s in MODES if s.family is not None)
"""The save-list families' names (``attn``, ...), in `MODES`' order."""

SAVE_FAMILIES: dict[str, tuple[str, ...]] = {s.family: s.save or () for s in MODES if s.family is not None}
"""Named save lists a layer can take as ``selective:<name>`` (plain ``selective`` is
`DEFAULT_SAVE_OPS`: every weight matmul plus the attention kernels), in `MODES`' order."""

BY_MEMORY_SAVED: tuple[str, ...] = tuple(s.name for s in sorted(MODES, key=lambda s: s.saving))
"""Every mode's name, the one that saves the least memory per layer first (`ModeSpec.saving`)."""

UNKNOWN_GLYPH = "?"
"""The glyph of a choice that is no mode of `MODES`."""

_BY_NAME: dict[str, ModeSpec] = {s.name: s for s in MODES}


def spec(name: str) -> ModeSpec | None:
    """The `ModeSpec` of a mode as written (``full``, ``selective:attn``), or ``None`` if no mode is."""
    return _BY_NAME.get(name)
