"""Per-layer cost profile of one training step: memory, time and FLOPs per recompute mode.

A training step is cut into *segments* at the boundaries of the layers found by
`lightning_recompute.find_layers`::

    fixed (embeddings ...) | fwd:0 | fwd:1 | ... | fixed (head, loss) | fixed (head backward) |
    bwd:L-1 | ... | bwd:0 | fixed (embedding backward) | fixed (optimizer step)

Forward boundaries come from module hooks on each layer; backward boundaries from tensor hooks on
each layer's output (its backward starts when the gradient of its output is complete) and input
(its backward ends when the gradient of its input is). For every segment the profile records the
change of live tensor memory across it (``delta``), the highest point above its starting level
(``peak``, the transient), the bytes of parameter gradients it allocated (``grad``), its FLOPs
(`torch.utils.flop_counter.FlopCounterMode`), and its time. A layer's segments are measured once
per mode (one step with every layer in that mode), the rest once (they do not depend on the
policy). `lightning_recompute.planner.Planner` composes them into the peak and step time of any mixed policy.

Memory comes from the plugin's meters (`lightning_recompute.meter.memory_meter`): the CUDA
allocator's statistics on CUDA, and on CPU and meta the exact storage ledger of `StorageMeter`,
which is also what makes `profile_meta` possible: the same step on the meta device allocates
nothing, yet the ledger counts every byte a GPU would hold.

Entry points::

    profile_model(model, batch, layers="auto", *, modes=None, optimizer=None, loss_fn=None,
                  repeats=5, restore=True, clock=time.perf_counter) -> Profile
    profile_meta(model_factory, batch, layers="auto", *, modes=None, optimizer=None, loss_fn=None,
                 hardware="H100", mfu=0.5) -> Profile
    Profile.to_dict() / Profile.from_dict(d) / to_json() / from_json(s)

Conventions and assumptions (the planner relies on them):

- The step is ``loss = loss_fn(model, batch); optimizer.zero_grad(set_to_none=True);
  loss.backward(); optimizer.step()``, in the order Lightning's automatic optimisation runs it:
  the previous step's gradients are alive through the forward and freed just before backward.
  The profiled step is the second one, so optimizer state and gradients exist (part of the base
  level, not of the step). ``zero_grad`` is a segment of its own (``fixed:loss->zero_grad``), so
  the planner can also predict a job that frees them at batch start (`RecomputeCallback`'s
  default where safe; `Profile.free_grads_at_batch_start` records which the job does).
- Every layer runs once per step, in order, and its backward runs after every later layer's.
- A layer's ``fwd`` delta is what it keeps for backward *including its output* (the next layer
  holds it); the net change of a layer over its forward and backward (``net``: its parameter
  gradients, plus the difference between its output and input sizes) does not depend on its mode.
- Time: the median over ``repeats`` interleaved steps per mode; layers of identical class,
  parameter shapes and input shape share their time samples (the median of the pooled samples);
  their memory is measured for each layer exactly. Without real hardware (`profile_meta`) time is
  *estimated* from FLOPs and memory traffic against a table of device peaks (`HARDWARE`), and the
  profile says so in ``time_source``.
- ``offload`` on CPU: the plugin runs such layers exactly as ``none`` (activations already live in
  host memory), so the profile copies ``none``'s costs rather than measuring noise twice. On the
  meta device the plugin cannot offload either, so the profile emulates
  `torch.autograd.graph.save_on_cpu` itself (every saved tensor leaves device memory in forward
  and comes back, as a new allocation, when backward unpacks it).
- ``selective`` works on the meta device (PyTorch's selective checkpointing only decides which op
  outputs to cache; it needs no data).

Modules: `lightning_recompute.profile.model` (the data model and its JSON form),
`lightning_recompute.profile.hardware` (device peaks for estimates), `lightning_recompute.profile.recorder`
(the instruments of one step), `lightning_recompute.profile.measure` (`profile_model`),
`lightning_recompute.profile.meta` (`profile_meta`), `tuner.recipe._profile` (the profile of a recipe's model
and data, what the tuning session and ``recompute-tune plan`` take).
"""

from __future__ import annotations

from lightning_recompute.profile.hardware import HARDWARE, Hardware
from lightning_recompute.profile.measure import profile_model
from lightning_recompute.profile.meta import profile_meta
from lightning_recompute.profile.model import ALL_MODES, LayerProfile, Profile, ProfileError, SegmentCost

__all__ = [
    "ALL_MODES",
    "HARDWARE",
    "Hardware",
    "LayerProfile",
    "Profile",
    "ProfileError",
    "SegmentCost",
    "profile_meta",
    "profile_model",
]
