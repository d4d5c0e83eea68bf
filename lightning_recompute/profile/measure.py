"""Measuring a profile on real hardware (`profile_model`): uniform-mode steps cut into segments at layer boundaries."""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from lightning_recompute import RecomputePolicy, applied_policy, apply_policy, find_layers, remove_policy
from lightning_recompute.layers import LayerSpec
from lightning_recompute.meter import StorageMeter, memory_meter
from lightning_recompute.policy import Mode
from lightning_recompute.profile.model import ALL_MODES, BASE_MODES, LayerProfile, Profile, ProfileError, SegmentCost
from lightning_recompute.profile.recorder import Event, Recorder, TrafficMode

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def _default_loss_fn(model: nn.Module) -> LossFn:
    """``training_step`` for a LightningModule; ``model.loss(batch)`` if it has one; else ``model(batch)``."""
    try:
        import lightning as L

        is_lightning = isinstance(model, L.LightningModule)
    except ImportError:  # pragma: no cover - lightning is a dependency
        is_lightning = False
    if is_lightning:
        if not model.automatic_optimization:
            raise ProfileError(
                f"model: {type(model).__name__} uses manual optimization;"
                f" pass loss_fn=(model, batch) -> loss to profile it"
            )

        def lightning_step(m: nn.Module, batch: Any) -> torch.Tensor:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*self.log.*")
                training_step = cast("Callable[[Any, int], Any]", m.training_step)
                out = training_step(batch, 0)
            return out["loss"] if isinstance(out, dict) else out

        return lightning_step
    if callable(getattr(model, "loss", None)):
        return lambda m, batch: cast("Callable[[Any], torch.Tensor]", m.loss)(batch)
    return lambda m, batch: m(batch)


def _frees_grads(model: nn.Module, flag: bool | None) -> bool:
    """Whether the profiled job frees gradients at batch start: ``flag``, or `RecomputeCallback`'s default."""
    if flag is not None:
        return bool(flag)
    import lightning as L

    from lightning_recompute.grads import module_blockers

    if not isinstance(model, L.LightningModule):
        return False  # no callback, no Lightning loop: the profile's order is the job's
    hard, soft = module_blockers(model)
    return not hard and not soft


def _make_optimizer(model: nn.Module, optimizer: Any, notes: list[str]) -> torch.optim.Optimizer:
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        return optimizer(model.parameters())
    if optimizer is not None:
        raise ProfileError(
            f"optimizer: expected an Optimizer, a callable params -> Optimizer, or None; got {type(optimizer).__name__}"
        )
    configure = getattr(model, "configure_optimizers", None)
    if callable(configure):
        out = configure()
        found = _find_optimizer(out)
        if found is not None:
            return found
        raise ProfileError(
            f"optimizer: {type(model).__name__}.configure_optimizers() returned {type(out).__name__}, "
            f"in which no torch.optim.Optimizer was found; pass optimizer= explicitly"
        )
    notes.append("optimizer: none given and the model has no configure_optimizers; profiled with AdamW")
    return torch.optim.AdamW(model.parameters())


def _find_optimizer(out: Any) -> torch.optim.Optimizer | None:
    if isinstance(out, torch.optim.Optimizer):
        return out
    if isinstance(out, dict):
        return _find_optimizer(out.get("optimizer"))
    if isinstance(out, (list, tuple)):
        for item in out:
            found = _find_optimizer(item)
            if found is not None:
                return found
    return None


def _run_step(
    model: nn.Module, batch: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer, rec: Recorder | None
) -> None:
    mark = rec.mark if rec is not None else (lambda label: None)
    mark("step")
    loss = loss_fn(model, batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ProfileError(
            f"loss_fn: must return a scalar loss tensor, got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )
    mark("loss")
    # Where Lightning's automatic optimisation zeroes gradients; its own segment, so the planner can move it.
    optimizer.zero_grad(set_to_none=True)
    mark("zero_grad")
    loss.backward()
    del loss
    mark("backward")
    optimizer.step()
    mark("optimizer")


def _segments(events: list[Event], n_layers: int) -> list[tuple[str, list[Event]]]:
    """Cut the events into keyed segments (see docs in `lightning_recompute.profile`), ends included."""
    out: list[tuple[str, list[Event]]] = []
    k = 0
    while k < len(events) - 1:
        kind, _, idx = events[k].label.partition(":")
        end = k + 1
        if kind == "fwd_start":
            # The gap after a layer's forward belongs to it (an offloaded layer's input is freed there).
            if (
                events[end].label == f"fwd_end:{idx}"
                and end + 1 < len(events)
                and events[end + 1].label.startswith("fwd_start:")
            ):
                end += 1
            key = f"fwd:{idx}"
        elif kind == "bwd_start":
            key = f"bwd:{idx}"
        else:
            key = f"fixed:{events[k].label}->{events[end].label}"
        out.append((key, events[k : end + 1]))
        k = end
    seen = [key for key, _ in out if not key.startswith("fixed:")]
    expected = [f"fwd:{i}" for i in range(n_layers)] + [f"bwd:{i}" for i in reversed(range(n_layers))]
    if seen != expected:
        raise ProfileError(
            "the step did not run each layer once in order with backward in reverse order "
            f"(segments seen: {seen[:8]}{' ...' if len(seen) > 8 else ''}); the planner models a stack of layers "
            "each called once per step. Choose layers= that the model calls exactly once each"
        )
    return out


def _cost(events: list[Event], scales: bool) -> SegmentCost:
    a, b = events[0], events[-1]
    return SegmentCost(
        delta=b.level - a.level,
        peak=max(0, max(e.peak for e in events[1:]) - a.level),
        grad=b.grad - a.grad,
        seconds=b.time - a.time,
        flops=b.flops - a.flops,
        traffic=b.traffic - a.traffic,
        offload=b.offload - a.offload,
        scales=scales,
    )


def _storage_bytes(tensors: Iterable[torch.Tensor], device_type: str) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == device_type:
            s = t.untyped_storage()
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def _batch_size(batch: Any) -> int:
    flat, _ = tree_flatten(batch)
    for v in flat:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
    raise ProfileError("batch: found no tensor with a batch dimension in the batch")


def check_modes(modes: Sequence[str] | None, device: torch.device) -> list[str]:
    """``modes`` checked and normalised (``none`` first); the base modes for ``None``."""
    if modes is None:
        return list(BASE_MODES)
    out = []
    for m in modes:
        name = m.value if isinstance(m, Mode) else str(m).strip().lower()
        if name not in ALL_MODES:
            raise ProfileError(f"modes: unknown mode {m!r}; valid modes are: {', '.join(ALL_MODES)}")
        out.append(name)
    if not out:
        raise ProfileError(f"modes: empty; valid modes are: {', '.join(ALL_MODES)}")
    if Mode.NONE.value not in out:
        out.insert(0, Mode.NONE.value)  # the reference every recomputation is measured against
    return list(dict.fromkeys(out))


def least_kept(modes: Sequence[str]) -> str:
    """The mode of ``modes`` that keeps the least between forward and backward."""
    return Mode.FULL.value if Mode.FULL.value in modes else Mode.NONE.value


class Split:
    """A mode that does not fit with every layer in it, profiled from steps that do: one group of layers
    in the mode per step, the rest in a mode that keeps less (each layer measured in its own place).
    """

    def __init__(self, n_layers: int, groups: list[list[int]], runs: list[Recorder], policies: list[Any]) -> None:
        self.n_layers, self.groups, self.runs, self.policies = n_layers, groups, runs, policies
        self._owner = {i: g for g, members in enumerate(groups) for i in members}

    def segments(self) -> list[tuple[str, list[Event]]]:
        """Each layer's segments from the run where it was in the mode, the rest from the first run."""
        per_run = [_segments(rec.events, self.n_layers) for rec in self.runs]
        return [(key, dict(per_run[self._source(key)])[key]) for key, _ in per_run[0]]

    def times(self, timed: list[dict[str, float]]) -> dict[str, float]:
        """One timed round's segment seconds from the runs' (one dict per group), composed alike."""
        return {key: timed[self._source(key)][key] for key in timed[0]}

    def _source(self, key: str) -> int:
        kind, _, idx = key.partition(":")
        return self._owner[int(idx)] if kind in ("fwd", "bwd") else 0

    def peaks(self) -> list[int]:
        """Each run's measured peak."""
        return [max((e.peak for e in rec.events), default=0) for rec in self.runs]


class ProfilingRun:
    """Shared machinery of `profile_model` and `profile_meta`: one model, one batch, uniform-mode runs."""

    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        layers: LayerSpec,
        modes: list[str],
        optimizer: Any,
        loss_fn: LossFn | None,
        device: torch.device,
        free_grads_at_batch_start: bool | None = None,
    ) -> None:
        self.model, self.batch, self.layer_spec, self.modes, self.device = model, batch, layers, modes, device
        self.free_grads = _frees_grads(model, free_grads_at_batch_start)
        self.notes: list[str] = []
        self.layers = find_layers(model, layers)
        self.names = [n for n, _ in self.layers]
        self.loss_fn = loss_fn or _default_loss_fn(model)
        self.optimizer = _make_optimizer(model, optimizer, self.notes)

    def apply(self, mode: str | RecomputePolicy) -> None:
        policy = mode if isinstance(mode, RecomputePolicy) else RecomputePolicy.uniform(mode)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*offload.*")
            apply_policy(self.model, policy, self.layer_spec)

    def group_policy(self, mode: str, group: Sequence[int], rest: str) -> RecomputePolicy:
        """The layers of ``group`` (indices) in ``mode``, every other layer in ``rest``."""
        members = set(group)
        return RecomputePolicy.from_modes({n: mode if i in members else rest for i, n in enumerate(self.names)})

    def memory_run(self, mode: str | RecomputePolicy, emulate_offload: bool) -> Recorder:
        """Two steps with every layer in ``mode``: memory and traffic from the first, FLOPs from the second.

        Apart because FlopCounterMode's module tracker keeps recomputed tensors alive, which the meter would see.
        """
        self.apply(Mode.NONE.value if emulate_offload else mode)
        offload = frozenset(range(len(self.layers))) if emulate_offload else frozenset()
        meter = memory_meter(self.device)
        meter.track(self.model, self.optimizer, self.batch)
        traffic = TrafficMode(FlopCounterMode(display=False).flop_registry)
        try:
            with Recorder(self.model, self.layers, self.device, meter, None, traffic, offload) as rec, meter, traffic:
                _run_step(self.model, self.batch, self.loss_fn, self.optimizer, rec)
        finally:
            if isinstance(meter, StorageMeter):
                meter.close()
        counter = FlopCounterMode(display=False)
        with Recorder(self.model, self.layers, self.device, None, counter, None, offload) as frec, counter:
            _run_step(self.model, self.batch, self.loss_fn, self.optimizer, frec)
        if [e.label for e in frec.events] != [e.label for e in rec.events]:
            raise ProfileError(
                f"mode {mode}: two identical steps ran different layer sequences; the model's control flow varies"
            )
        for e, f in zip(rec.events, frec.events, strict=False):
            e.flops = f.flops
        return rec

    def warm_up(self) -> None:
        """One step in the mode that keeps least, so the measured steps see the optimizer state in the base."""
        self.apply(least_kept(self.modes))
        _run_step(self.model, self.batch, self.loss_fn, self.optimizer, None)

    def build(
        self,
        mem: dict[str, Recorder | Split],
        times: dict[str, list[dict[str, float]]] | None,
        time_source: str,
        hardware: str | None,
        estimate: Callable[[SegmentCost], float] | None,
    ) -> Profile:
        n = len(self.layers)
        segs = {m: rec.segments() if isinstance(rec, Split) else _segments(rec.events, n) for m, rec in mem.items()}
        keys = [k for k, _ in segs[Mode.NONE.value]]
        for m, s in segs.items():
            if [k for k, _ in s] != keys:
                raise ProfileError(
                    f"the step's structure differs between mode none and mode {m} "
                    f"({len(keys)} vs {len(s)} segments); the model must call the same layers in the same order"
                )
        by_mode = {m: {k: _cost(ev, scales=k != "fixed:backward->optimizer") for k, ev in s} for m, s in segs.items()}
        none = by_mode[Mode.NONE.value]
        first = mem[Mode.NONE.value]
        rec0 = first.runs[0] if isinstance(first, Split) else first
        layer_profiles, groups = self._layers(by_mode, rec0)
        fixed = {k[len("fixed:") :]: c for k, c in none.items() if k.startswith("fixed:")}
        if times is not None:
            self._assign_times(layer_profiles, fixed, times, groups)
        elif estimate is not None:
            for lp in layer_profiles:
                for c in (*lp.fwd.values(), *lp.bwd.values()):
                    c.seconds = estimate(c)
            for c in fixed.values():
                c.seconds = estimate(c)
        shared = [g for g in groups.values() if len(g) > 1]
        if shared and times is not None:
            self.notes.append(
                "time: layers of identical class, parameter shapes and input shape share their time samples "
                f"(median of the pooled samples): {'; '.join(_span(g) for g in shared)}; memory is per layer"
            )
        return Profile(
            layers=layer_profiles,
            timeline=keys,
            fixed=fixed,
            modes=list(self.modes),
            base_bytes=rec0.events[0].level,
            param_bytes=_storage_bytes(self.model.parameters(), self.device.type),
            # A gradient is the size of its parameter (per-segment growth would miss the head's).
            grad_bytes=_storage_bytes((p for p in self.model.parameters() if p.requires_grad), self.device.type),
            optimizer_bytes=_storage_bytes(
                (v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
                self.device.type,
            ),
            batch_bytes=_storage_bytes(tree_flatten(self.batch)[0], self.device.type),
            micro_batch=_batch_size(self.batch),
            device=str(self.device),
            time_source=time_source,
            hardware=hardware,
            groups=groups,
            notes=self.notes,
            free_grads_at_batch_start=self.free_grads,
            split={m: len(rec.groups) for m, rec in mem.items() if isinstance(rec, Split) and m in self.modes},
        )

    def _layers(
        self, by_mode: dict[str, dict[str, SegmentCost]], rec0: Recorder
    ) -> tuple[list[LayerProfile], dict[str, list[str]]]:
        """Each layer's costs per mode, and the groups of layers alike enough to share time samples."""
        groups: dict[str, list[str]] = {}
        layer_profiles: list[LayerProfile] = []
        for i, (name, module) in enumerate(self.layers):
            params = ",".join(f"{n}{tuple(p.shape)}:{str(p.dtype)[6:]}" for n, p in module.named_parameters())
            group = f"{type(module).__qualname__}[{params}]<-{rec0.input_shapes.get(i, '?')}"
            groups.setdefault(group, []).append(name)
            fwd = {m: by_mode[m][f"fwd:{i}"] for m in self.modes}
            bwd = {m: by_mode[m][f"bwd:{i}"] for m in self.modes}
            nets = {m: fwd[m].delta + bwd[m].delta for m in self.modes}
            net = nets[Mode.NONE.value]
            spread = max(nets.values()) - min(nets.values())
            if spread > max(1024, 0.01 * abs(fwd[Mode.NONE.value].delta)):
                self.notes.append(
                    f"{name}: forward+backward leaves {spread} bytes more in some mode than in another "
                    f"({nets}); the planner uses mode none's {net}"
                )
            param_bytes = _storage_bytes(module.parameters(), self.device.type)
            layer_profiles.append(LayerProfile(name, group, param_bytes, fwd, bwd, net))
        return layer_profiles, groups

    def _assign_times(
        self,
        layers: list[LayerProfile],
        fixed: dict[str, SegmentCost],
        times: dict[str, list[dict[str, float]]],
        groups: dict[str, list[str]],
    ) -> None:
        index = {lp.name: i for i, lp in enumerate(layers)}
        for mode, runs in times.items():
            for members in groups.values():
                for phase in ("fwd", "bwd"):
                    samples = [run[f"{phase}:{index[name]}"] for run in runs for name in members]
                    med = statistics.median(samples)
                    for name in members:
                        getattr(layers[index[name]], phase)[mode].seconds = med
        runs_none = times[Mode.NONE.value]
        for key, cost in fixed.items():
            cost.seconds = statistics.median(run[f"fixed:{key}"] for run in runs_none)
        # Offload on CPU is none: same times, not a second noisy sample.
        for lp in layers:
            for phase in ("fwd", "bwd"):
                costs = getattr(lp, phase)
                if Mode.OFFLOAD.value in costs and Mode.OFFLOAD.value not in times:
                    costs[Mode.OFFLOAD.value].seconds = costs[Mode.NONE.value].seconds


def _span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"


def profile_model(
    model: nn.Module,
    batch: Any,
    layers: LayerSpec = "auto",
    *,
    modes: Sequence[str] | None = None,
    optimizer: torch.optim.Optimizer | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    loss_fn: LossFn | None = None,
    repeats: int = 5,
    restore: bool = True,
    clock: Callable[[], float] = time.perf_counter,
    free_grads_at_batch_start: bool | None = None,
) -> Profile:
    """Measure the per-layer, per-mode costs of a training step of ``model`` on ``batch``.

    One warm-up step, one metered step per mode, then ``repeats`` timed rounds in rotating order, on the
    device of the model's parameters (see `lightning_recompute.profile` for the conventions).

    Args:
        model: an ``nn.Module`` or LightningModule (its ``training_step`` and ``configure_optimizers``
            are used unless ``loss_fn`` / ``optimizer`` are given).
        batch: one micro-batch, as the training step receives it.
        layers: which modules are layers (see `lightning_recompute.layers.LayerSpec`).
        modes: the modes to profile (default: the base modes); ``none`` is always included.
        optimizer: an optimizer over ``model``'s parameters, or a factory ``params -> optimizer``.
        loss_fn: ``(model, batch) -> scalar loss``.
        repeats: timed steps per mode (>= 1); the medians are kept.
        restore: put parameters and buffers back afterwards (a given ``optimizer``'s state does advance).
        clock: the timer; ``time.thread_time`` measures the step's own work on a shared CPU.
        free_grads_at_batch_start: whether the job frees gradients at batch start; ``None``:
            `RecomputeCallback`'s default for this model.

    Raises:
        ProfileError: bad arguments, or a model whose layers do not run once each in order.
        LayerDiscoveryError: ``layers`` found nothing.
    """
    if not isinstance(model, nn.Module):
        raise ProfileError(f"model: expected an nn.Module, got {type(model).__name__}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ProfileError(f"repeats: must be a positive integer, got {repeats!r}")
    if not callable(clock):
        raise ProfileError(f"clock: expected a callable returning seconds (time.perf_counter), got {clock!r}")
    param = next(model.parameters(), None)
    if param is None:
        raise ProfileError(f"model: {type(model).__name__} has no parameters; nothing to train, nothing to profile")
    device = param.device
    if device.type == "meta":
        raise ProfileError(
            "model: its parameters are on the meta device; use profile_meta(model_factory, batch)"
            " to plan without memory"
        )
    mode_list = check_modes(modes, device)
    batch = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)
    previous = applied_policy(model)
    snapshot = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()} if restore else None
    was_training = model.training
    model.train()
    try:
        session = ProfilingRun(model, batch, layers, mode_list, optimizer, loss_fn, device, free_grads_at_batch_start)
        return _measure(session, mode_list, repeats, clock)
    finally:
        remove_policy(model)
        if previous is not None:
            apply_policy(model, previous.policy, layers)
        if snapshot is not None:
            model.load_state_dict(snapshot)
        model.train(was_training)


def _measure(session: ProfilingRun, mode_list: list[str], repeats: int, clock: Callable[[], float]) -> Profile:
    """One warm-up step, one metered step per mode (`Split` where it does not fit), then the timed rounds."""
    model, batch, device = session.model, session.batch, session.device
    session.warm_up()
    # On CPU offload is none: measure it once, as none.
    measured = [m for m in mode_list if not (m == Mode.OFFLOAD.value and device.type != "cuda")]
    if len(measured) < len(mode_list):
        session.notes.append("offload: the plugin runs it as none on this device; its costs are none's")
    mem: dict[str, Recorder | Split] = {}
    too_big = []
    for m in sorted(measured, key=lambda m: m != least_kept(measured)):  # the fallback first
        try:
            mem[m] = session.memory_run(m, emulate_offload=False)
        except torch.OutOfMemoryError:
            too_big.append(m)
        else:
            continue
        _recover(session)
    rest = least_kept(measured)
    if rest not in mem:
        raise torch.OutOfMemoryError(
            f"the model does not fit on {device} even with every layer in {rest} (out of memory at micro-batch "
            f"{_batch_size(batch)}); a smaller micro-batch, or more devices, is needed"
        )
    for m in too_big:
        mem[m] = _split_run(session, m, rest)
    for m in mode_list:
        mem.setdefault(m, mem[Mode.NONE.value])
    times: dict[str, list[dict[str, float]]] = {m: [] for m in measured}
    n = len(session.layers)
    for r in range(repeats + 1):  # round 0 warms each mode's code paths up; it is not kept
        order = measured[r % len(measured) :] + measured[: r % len(measured)]
        for m in order:
            split = mem[m]
            runs = split.policies if isinstance(split, Split) else [m]
            timed = []
            for policy in runs:
                session.apply(policy)
                with Recorder(model, session.layers, device, None, None, None, clock=clock) as rec:
                    _run_step(model, batch, session.loss_fn, session.optimizer, rec)
                timed.append({k: ev[-1].time - ev[0].time for k, ev in _segments(rec.events, n)})
            if r > 0:
                times[m].append(split.times(timed) if isinstance(split, Split) else timed[0])
    return session.build(mem, times, "measured", None, None)


def _split_run(session: ProfilingRun, mode: str, rest: str) -> Split:
    """``mode`` profiled in 2, 4, ... groups of layers (the others in ``rest``) until every group's step fits."""
    n = len(session.layers)
    k = 2
    while True:
        size = -(-n // min(k, n))  # contiguous groups, as even as can be
        groups = [list(range(i, min(n, i + size))) for i in range(0, n, size)]
        policies = [session.group_policy(mode, g, rest) for g in groups]
        try:
            runs = [session.memory_run(p, emulate_offload=False) for p in policies]
        except torch.OutOfMemoryError:
            runs = []
        if not runs:
            _recover(session)
            if k >= n:
                raise torch.OutOfMemoryError(
                    f"mode {mode}: one layer in it, the others in {rest}, does not fit on {session.device}"
                ) from None
            k *= 2
            continue
        session.notes.append(
            f"{mode}: does not fit with every layer in it (out of memory); profiled in {len(groups)} steps, "
            f"each with {len(groups[0])} layer(s) in {mode} and the rest {rest}"
        )
        return Split(n, groups, runs, policies)


def _recover(session: ProfilingRun) -> None:
    """After an out-of-memory step (outside its ``except``, whose traceback holds its activations): free
    what it left and run a step in the mode that keeps least, so every gradient exists again.
    """
    import gc

    gc.collect()
    if session.device.type == "cuda":
        torch.cuda.empty_cache()
    session.warm_up()
