"""The peers' ways of choosing what to recompute, implemented by hand for bench/compare.py.

Each function changes a model in place the way the peer's code would, so the benchmark can time
and meter it next to the plugin's own policies:

- `apply_op_sac`: torchtitan's ``op`` selective checkpointing: every block checkpointed with a
  selective-checkpoint ``policy_fn`` that saves compute-heavy ops (matmuls, attention kernels)
  except every second matmul. Our policy file cannot say "every other mm", hence a hand policy.
- `apply_sqrt_segments`: Chen et al. 2016: cut the stack into segments of about sqrt(N) layers
  and keep only each segment's input; backward recomputes one segment at a time.
- `apply_compile`: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget``
  (AOTAutograd's min-cut partitioner decides what to save under the budget), either with inductor
  (for timing) or with the same partitioner and decompositions executed op by op (for metering,
  because inductor's generated code allocates outside the dispatcher where the CPU ledger cannot
  see it).
- `probe_sac_ilp`: whether PyTorch's own automatic SAC solver (``torch.distributed._tools``:
  MemTracker + RuntimeEstimator + SACEstimator -> ``sac_milp``) runs on this machine; run it as
  ``python bench/compare_methods.py sac-ilp-probe`` (a subprocess: a failed MemTracker leaves
  global module hooks behind that would disturb every later measurement in the process).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_recompute import StorageMeter, find_layers

__all__ = ["apply_compile", "apply_op_sac", "apply_sqrt_segments", "probe_sac_ilp", "sqrt_segment_size"]

# torchtitan's _save_list, restricted to what exists on a single CPU process. Our nn.Linear layers
# have biases, so their GEMMs dispatch as aten.addmm; torchtitan's bias-free Linears run aten.mm.
# Both count as "mm" for the every-other rule.
_MM_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})
_ATTENTION_OPS = frozenset(
    op
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
    )
    if (packet := getattr(torch.ops.aten, name, None)) is not None
    for op in (getattr(packet, o) for o in packet.overloads())
)


# --------------------------------------------------------------------------------------------- op-level SAC


class _LayerForward:
    """An instance ``forward`` that runs the class forward under non-reentrant checkpoint.

    A callable object (not a closure) so the model stays picklable; the same mechanism as the
    plugin's, so the comparison is of *what* is saved, not of wrapping overhead.
    """

    def __init__(self, module: nn.Module, context_fn: Callable[[], Any] | None) -> None:
        self.module = module
        self.context_fn = context_fn

    def _inner(self, *args: Any) -> Any:
        return type(self.module).forward(self.module, *args)

    def __call__(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self._inner(*args)
        extra = {} if self.context_fn is None else {"context_fn": self.context_fn}
        return checkpoint(self._inner, *args, use_reentrant=False, **extra)


def _op_sac_context() -> tuple[Any, Any]:
    # One counter per context pair, like torchtitan's `meta` dict: forward and recomputation count
    # their matmuls separately, so the same matmuls are skipped in both.
    meta = {"forward": 0, "recompute": 0}

    def policy_fn(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        key = "recompute" if ctx.is_recompute else "forward"
        if func in _MM_OPS:
            meta[key] += 1
            return CheckpointPolicy.PREFER_RECOMPUTE if meta[key] % 2 == 0 else CheckpointPolicy.MUST_SAVE
        if func in _ATTENTION_OPS:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy_fn)


def apply_op_sac(model: nn.Module) -> None:
    """torchtitan ``--activation-checkpoint.mode selective --selective-ac-option op`` on every layer.

    The benchmark's models run attention without dropout, so saving the attention kernel's output
    replays no random draw differently (the plugin refuses to cache a kernel that draws).
    """
    for _, layer in find_layers(model, "auto"):
        layer.forward = _LayerForward(layer, _op_sac_context)  # type: ignore[method-assign]


# --------------------------------------------------------------------------------------------- sqrt(N)


def sqrt_segment_size(n_layers: int) -> int:
    """Chen et al.'s segment length: sqrt(N) rounded, at least 1."""
    return max(1, round(math.sqrt(n_layers)))


class _PassThrough:
    """The forward of a layer whose segment head already ran it."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _SegmentForward:
    """The forward of a segment's first layer: the whole segment under one checkpoint."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = type(layer).forward(layer, x)
        return x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self._inner(x)
        return checkpoint(self._inner, x, use_reentrant=False)


def apply_sqrt_segments(model: nn.Module) -> int:
    """Checkpoint segments of about sqrt(N) consecutive layers; returns the segment length.

    Works for stacks whose layers are called one after another with one tensor (what
    ``torch.utils.checkpoint.checkpoint_sequential`` assumes too): the first layer of a segment
    runs the segment, the others pass their input through, and the module tree is unchanged.
    """
    layers = [m for _, m in find_layers(model, "auto")]
    size = sqrt_segment_size(len(layers))
    for start in range(0, len(layers), size):
        segment = layers[start : start + size]
        segment[0].forward = _SegmentForward(segment)  # type: ignore[method-assign]
        for later in segment[1:]:
            later.forward = _PassThrough()  # type: ignore[method-assign]
    return size


# --------------------------------------------------------------------------------------------- torch.compile


def _metered_backend(meter_of: Callable[[], StorageMeter | None]) -> Any:
    """AOTAutograd with inductor's decompositions and min-cut partitioner, graphs run op by op.

    This is ``aot_eager_decomp_partition`` (the same partition inductor gets) with one change: the
    forward graph runs with the step's storage meter on. Dynamo does not run compiled code while a
    dispatch mode is active (it falls back to eager), so the caller stops the meter around the
    compiled call and the forward graph restarts it inside; the backward graph runs inside
    ``loss.backward()``, where the meter is on anyway.
    """
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    def fw_compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        def run(args: list[Any]) -> Any:
            meter = meter_of()
            if meter is None:
                return gm(*args)
            meter.start()
            try:
                return gm(*args)
            finally:
                meter.stop()

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def bw_compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return make_boxed_func(gm)

    return aot_autograd(
        fw_compiler=fw_compiler,
        bw_compiler=bw_compiler,
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
        keep_inference_input_mutations=True,
    )


class _CompiledForward:
    """The model's forward, compiled, always called under its activation-memory budget."""

    def __init__(
        self, compiled: Callable[..., Any], budget: float, meter_of: Callable[[], StorageMeter | None] | None
    ) -> None:
        self.compiled = compiled
        self.budget = budget
        self.meter_of = meter_of

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        import torch._functorch.config as functorch_config

        # The budget is read when AOTAutograd partitions (first call, and any recompile): keep it
        # set on every call so a recompile cannot silently fall back to the default of 1.0.
        with functorch_config.patch(activation_memory_budget=self.budget):
            meter = self.meter_of() if self.meter_of is not None else None
            running = meter is not None and getattr(meter, "_mode", None) is not None  # StorageMeter internals
            if running:
                meter.stop()  # type: ignore[union-attr]
            try:
                return self.compiled(idx)
            finally:
                if running:
                    meter.start()  # type: ignore[union-attr]


def apply_compile(
    model: nn.Module, budget: float, *, metered: bool, meter_of: Callable[[], StorageMeter | None] | None = None
) -> None:
    """``torch.compile`` the model's forward under ``activation_memory_budget=budget``.

    ``metered=False``: inductor (real generated kernels; for timing). ``metered=True``: the same
    partition run op by op, with ``meter_of()`` (the step's StorageMeter, or None) seeing every
    allocation of the forward graph (for the peak).
    """
    import torch._dynamo

    # Several compiled models live side by side (one per budget, metered and not): each needs its
    # own cache entry rather than evicting the others.
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(256, getattr(torch._dynamo.config, name)))
    tag = f"{'metered' if metered else 'inductor'}:{budget:.6f}"

    def forward(idx: torch.Tensor, _model: nn.Module = model, _tag: str = tag) -> torch.Tensor:
        # `_tag` is read so dynamo guards on it: two models of one class under different budgets
        # or backends must not share a compiled graph (parameters are graph inputs, not guards).
        if _tag:
            return type(_model).forward(_model, idx)
        return type(_model).forward(_model, idx)

    backend: Any = _metered_backend(meter_of or (lambda: None)) if metered else "inductor"
    compiled = torch.compile(forward, backend=backend, dynamic=False)
    model.forward = _CompiledForward(compiled, budget, meter_of if metered else None)  # type: ignore[method-assign]


# --------------------------------------------------------------------------------------------- torch SAC ILP


def probe_sac_ilp(mode: str) -> dict[str, Any]:
    """Try PyTorch's automatic SAC pipeline on a tiny reference GPT, with runtime estimation ``mode``
    (``operator-level-benchmark`` or ``operator-level-cost-model``).

    Returns ``{"ok": bool, "stage": str, "error": str | None, "detail": str}``: how far it got.
    One mode per process: a failed attempt leaves MemTracker's global hooks registered.
    """
    out: dict[str, Any] = {"ok": False, "stage": "import", "error": None, "detail": ""}
    try:
        import pulp

        out["detail"] += f"pulp {pulp.__version__} present; "
    except ImportError as err:
        out["error"] = f"pulp not importable ({err}); sac_ilp imports it at module level"
        return out
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed._tools.ilp_utils import aggregate_stats, parse_module_info
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed._tools.runtime_estimator import RuntimeEstimator
        from torch.distributed._tools.sac_estimator import SACEstimator
        from torch.distributed._tools.sac_ilp import sac_milp

        from lightning_recompute.reference import ReferenceGPT
    except ImportError as err:
        out["error"] = f"{type(err).__name__}: {err}"
        return out
    out["stage"] = f"estimate ({mode})"
    try:
        # The estimators require fake tensors (they refuse real ones).
        with FakeTensorMode():
            model = ReferenceGPT(vocab_size=64, seq_len=16, n_layer=2, n_embd=32, n_head=2, dropout=0.0)
            opt = torch.optim.AdamW(model.parameters())
            x = torch.randint(0, 64, (2, 17))
            batch = (x[:, :-1].contiguous(), x[:, 1:].contiguous())
            tracker, runtime, sac = MemTracker(), RuntimeEstimator(), SACEstimator()
            tracker.track_external(model, opt)
            with tracker, runtime(mode), sac(mode):
                model.loss(batch).backward()
            out["stage"] = f"solve ({mode})"
            graph = parse_module_info(aggregate_stats(model, tracker, runtime, sac, torch.device("cpu")))
            decisions, _, _ = sac_milp(graph, memory_budget=0.01, world_size=1)
        out.update(ok=True, error=None)
        out["detail"] += f"{mode}: solved, decisions {decisions}"
    except Exception as err:  # noqa: BLE001 - the probe reports whatever stops the pipeline
        out["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "sac-ilp-probe":
        torch.set_num_threads(1)
        print(json.dumps(probe_sac_ilp(sys.argv[2])))
    else:
        raise SystemExit("usage: python bench/compare_methods.py sac-ilp-probe MODE")
