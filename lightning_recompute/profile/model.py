"""The profile's data model (`SegmentCost`, `LayerProfile`, `Profile`) and its JSON form."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from lightning_recompute.errors import RecomputeError
from lightning_recompute.modes import MODES, Mode
from lightning_recompute.units import format_bytes

BASE_MODES: tuple[str, ...] = tuple(s.name for s in MODES if not s.is_family)  # profiled unless told otherwise
FAMILY_MODES: tuple[str, ...] = tuple(s.name for s in MODES if s.is_family)  # selective:<family>, when asked for
ALL_MODES: tuple[str, ...] = BASE_MODES + FAMILY_MODES  # in the planner's canonical order, which breaks ties
PROFILE_VERSION = 1
ZERO_GRAD_SEGMENT = "loss->zero_grad"  # ``optimizer.zero_grad()`` alone: its delta is minus the gradients


class ProfileError(RecomputeError, ValueError):
    """The model, batch or options cannot be profiled as asked."""


@dataclass
class SegmentCost:
    """What one segment of the step costs."""

    delta: int = 0  # live device bytes at the segment's end minus at its start
    peak: int = 0  # highest live bytes during the segment minus the level at its start (>= 0)
    grad: int = 0  # bytes of parameter gradients allocated (or, negative, freed) in the segment
    seconds: float = 0.0
    flops: int = 0
    traffic: int = 0  # bytes read and written by ops without a FLOP formula (elementwise, norms, copies)
    offload: int = 0  # bytes copied to host memory in this segment's forward and back in its backward
    scales: bool = True  # whether the activation part grows with the micro-batch (false for the optimizer)
    static_delta: int = 0  # bytes of delta besides grad that do not grow with the micro-batch (sharding's buffers)
    static_peak: int = 0  # bytes of peak besides the gradients that do not grow with the micro-batch


@dataclass
class LayerProfile:
    """One layer's costs, per mode."""

    name: str
    group: str  # class, parameter shapes, input shape: layers of one group share time samples
    param_bytes: int
    fwd: dict[str, SegmentCost]  # per mode: the forward (delta = activation bytes kept, output included)
    bwd: dict[str, SegmentCost]  # per mode: the backward, recomputation included
    net: int  # bytes the layer's forward plus backward leave behind; mode-independent

    def kept_bytes(self, mode: str) -> int:
        return self.fwd[mode].delta

    def recompute_flops(self, mode: str) -> int:
        """FLOPs the backward spends beyond ``none``'s backward."""
        return max(0, self.bwd[mode].flops - self.bwd[Mode.NONE.value].flops) if Mode.NONE.value in self.bwd else 0


@dataclass
class Profile:
    """The cost profile of one training step of one model at one micro-batch; JSON-serialisable."""

    layers: list[LayerProfile]
    timeline: list[str]  # segment keys in execution order: fwd:<i>, bwd:<i> or fixed:<name>
    fixed: dict[str, SegmentCost]  # the segments no policy changes, by name
    modes: list[str]
    base_bytes: int  # live device bytes when the step starts: parameters, optimizer state, the batch, buffers
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    batch_bytes: int
    micro_batch: int
    device: str
    time_source: str  # "measured" or "estimated: ..."
    hardware: str | None = None
    groups: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    free_grads_at_batch_start: bool = False  # whether the job frees the last step's gradients at batch start
    split: dict[str, int] = field(default_factory=dict)  # modes that did not fit whole: steps each was profiled in
    torch_version: str = torch.__version__
    version: int = PROFILE_VERSION

    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    @property
    def estimated(self) -> bool:
        return self.time_source != "measured"

    @property
    def forward_grad_bytes(self) -> int | None:
        """Gradient bytes alive through the forward in Lightning's order; ``None`` for an older profile."""
        seg = self.fixed.get(ZERO_GRAD_SEGMENT)
        return None if seg is None else -seg.delta

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        if d.get("version") != PROFILE_VERSION:
            raise ProfileError(f"profile: unsupported version {d.get('version')!r}; valid: {PROFILE_VERSION}")

        def costs(by_mode: dict[str, Any]) -> dict[str, SegmentCost]:
            return {k: SegmentCost(**c) for k, c in by_mode.items()}

        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["layers"] = [LayerProfile(**{**x, "fwd": costs(x["fwd"]), "bwd": costs(x["bwd"])}) for x in d["layers"]]
        return cls(**{"torch_version": "", **kw, "fixed": costs(d["fixed"])})

    def describe(self) -> str:
        """A per-layer table of kept bytes, times and recomputed FLOPs per mode."""
        lines = [
            f"profile on {self.device} ({self.hardware or 'this machine'}), micro-batch {self.micro_batch},"
            f" time {self.time_source}",
            f"base {format_bytes(self.base_bytes)} = params {format_bytes(self.param_bytes)}"
            f" + optimizer {format_bytes(self.optimizer_bytes)}"
            f" + batch {format_bytes(self.batch_bytes)} (+ buffers); gradients {format_bytes(self.grad_bytes)}",
            "previous step's gradients in the forward: "
            + ("freed at batch start" if self.free_grads_at_batch_start else "alive (Lightning's order)"),
        ]
        # Every column at least two characters wider than its longest header or name.
        name_w = max(16, max((len(layer.name) for layer in self.layers), default=0) + 2)
        widths = {m: (max(16, len(m) + 7), max(14, len(m) + 5)) for m in self.modes}  # "<m> kept", "<m> ms"
        lines.append(
            f"{'layer':<{name_w}}" + "".join(f"{m + ' kept':>{k}}{m + ' ms':>{t}}" for m, (k, t) in widths.items())
        )
        for layer in self.layers:
            cells = (
                f"{format_bytes(layer.fwd[m].delta):>{k}}{1e3 * (layer.fwd[m].seconds + layer.bwd[m].seconds):>{t}.3f}"
                for m, (k, t) in widths.items()
            )
            lines.append(f"{layer.name:<{name_w}}" + "".join(cells))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
