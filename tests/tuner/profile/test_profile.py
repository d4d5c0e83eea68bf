"""The profile: exact per-layer bytes and FLOPs on the reference model, serialisation, the meta
device (same bytes as the CPU, nothing allocated at 7B scale), and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from bench.llama_like import LlamaConfig, LlamaLike, token_batch
from lightning_recompute import RecomputePolicy
from lightning_recompute.profile import HARDWARE, Profile, ProfileError, profile_meta, profile_model
from lightning_recompute.reference import ReferenceGPT
from tests.helpers import REPO

B, T, C, H = 4, 32, 32, 4
E = 4  # float32
BTC, BHTT = B * T * C, B * H * T * T


def _gpt(**kw: object) -> ReferenceGPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, seq_len=T, n_layer=3, n_embd=C, n_head=H, dropout=0.1, attention="eager")
    cfg.update(kw)
    return ReferenceGPT(**cfg)  # type: ignore[arg-type]


def _batch(b: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, 64, (b, T), generator=torch.Generator().manual_seed(0))
    return x, x.roll(-1, 1)


@pytest.fixture(scope="module")
def cpu_profile() -> Profile:
    return profile_model(_gpt(), _batch(), repeats=1)


def test_kept_bytes_per_mode_match_hand_computed_tensor_sizes(cpu_profile: Profile) -> None:
    # The same figures as the plugin's meter test (tests/plugin/test_meter.py), plus the layer's
    # output, which the profile counts as kept (the next layer holds it until its backward).
    none = 17 * BTC * E + 3 * BHTT * E + 4 * B * T * E + T * T + BTC * E
    for layer in cpu_profile.layers:
        assert layer.kept_bytes("none") == none
        assert layer.kept_bytes("selective") == 10 * BTC * E  # the four GEMM outputs (9 x BTC) + output
        assert layer.kept_bytes("full") == BTC * E  # the output only
        # Forward plus backward leave the layer's gradients behind, whatever the mode.
        params = sum(p.numel() for p in _gpt().blocks[0].parameters()) * E
        assert layer.net == params
        assert layer.fwd["full"].grad == 0 and layer.bwd["full"].grad == params


def test_recomputed_flops_are_exact(cpu_profile: Profile) -> None:
    layer = cpu_profile.layers[1]
    # full recomputes the whole forward; selective only the two attention bmms (q k^T and att v).
    assert layer.recompute_flops("full") == layer.fwd["none"].flops
    assert layer.recompute_flops("selective") == 2 * (2 * B * H * T * T * (C // H))
    assert layer.recompute_flops("none") == 0
    gemms = 2 * B * T * (C * 3 * C + C * C + C * 4 * C + 4 * C * C)
    assert layer.fwd["none"].flops == gemms + 2 * (2 * B * H * T * T * (C // H))


def test_fixed_part_and_offload_on_cpu(cpu_profile: Profile) -> None:
    params = sum(p.numel() for p in _gpt().parameters()) * E
    assert cpu_profile.param_bytes == params
    assert cpu_profile.grad_bytes == params
    # AdamW: exp_avg and exp_avg_sq, and a float32 step count per parameter tensor (on the CPU device,
    # so counted here; on CUDA and meta it stays on the host).
    n_tensors = len(list(_gpt().parameters()))
    assert cpu_profile.optimizer_bytes == 2 * params + 4 * n_tensors
    assert cpu_profile.batch_bytes == 2 * B * T * 8
    assert cpu_profile.base_bytes >= params + 2 * params + cpu_profile.batch_bytes
    # Embedding outputs (token, position, sum, dropout output and mask) and logits are non-layer activations.
    first_bwd = next(i for i, k in enumerate(cpu_profile.timeline) if k.startswith("bwd:"))
    forward_fixed = [cpu_profile.fixed[k[6:]] for k in cpu_profile.timeline[:first_bwd] if k.startswith("fixed:")]
    assert sum(c.delta - c.grad for c in forward_fixed) > B * T * 64 * E
    for layer in cpu_profile.layers:
        assert layer.fwd["offload"] == layer.fwd["none"] and layer.bwd["offload"] == layer.bwd["none"]
    assert any("offload" in n and "as none" in n for n in cpu_profile.notes)
    assert cpu_profile.time_source == "measured"
    assert all(
        layer.fwd[m].seconds > 0 and layer.bwd[m].seconds > 0 for layer in cpu_profile.layers for m in cpu_profile.modes
    )


def test_identical_layers_share_a_group_and_heterogeneous_ones_do_not(cpu_profile: Profile) -> None:
    assert list(cpu_profile.groups.values()) == [["blocks.0", "blocks.1", "blocks.2"]]
    assert any("share their time samples" in n for n in cpu_profile.notes)
    hetero = profile_model(_gpt(widths=[32, 32, 48]), _batch(), modes=["none", "full"], repeats=1)
    assert sorted(map(len, hetero.groups.values())) == [1, 1, 1]  # blocks.1 resizes; blocks.2 is wider
    assert hetero.layers[2].kept_bytes("none") > hetero.layers[0].kept_bytes("none")


def test_profile_round_trips_through_json(cpu_profile: Profile) -> None:
    text = json.dumps(cpu_profile.to_dict())
    again = Profile.from_dict(json.loads(text))
    assert again == cpu_profile
    assert json.loads(text)["layers"][0]["fwd"]["full"]["delta"] == BTC * E
    with pytest.raises(ProfileError, match="unsupported version 99; valid: 1"):
        Profile.from_dict({**cpu_profile.to_dict(), "version": 99})


def test_profiling_leaves_the_model_as_it_was() -> None:
    model = _gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile_model(model, _batch(), modes=["none", "full"], repeats=1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "forward" not in model.blocks[0].__dict__  # the policy is taken off again


def test_meta_profile_equals_the_cpu_profile_byte_for_byte(cpu_profile: Profile) -> None:
    meta = profile_meta(_gpt, _batch(), modes=["none", "selective", "full"], hardware="A100")
    assert meta.device == "meta" and meta.estimated and "estimated" in meta.time_source
    n_tensors = len(list(_gpt().parameters()))
    assert meta.base_bytes == cpu_profile.base_bytes - 4 * n_tensors  # AdamW's step counts stay on the host
    for lm, lc in zip(meta.layers, cpu_profile.layers, strict=False):
        for m in ("none", "selective", "full"):
            for phase in ("fwd", "bwd"):
                a, b = getattr(lm, phase)[m], getattr(lc, phase)[m]
                assert (a.delta, a.peak, a.grad, a.flops) == (b.delta, b.peak, b.grad, b.flops), (lm.name, m, phase)
    for key, seg in meta.fixed.items():
        assert (seg.delta, seg.peak) == (cpu_profile.fixed[key].delta, cpu_profile.fixed[key].peak), key


def test_meta_llama_selective_and_emulated_offload() -> None:
    cfg = LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    prof = profile_meta(lambda: LlamaLike(cfg), token_batch(2, 64, cfg.vocab_size), hardware="L4")
    layer = prof.layers[0]
    kept = {m: layer.kept_bytes(m) for m in prof.modes}
    assert kept["none"] > kept["selective"] > kept["full"] > 0
    # Offload keeps nothing on the device: even the layer's output leaves when the next layer saves it.
    assert kept["offload"] < kept["full"]
    assert layer.fwd["offload"].offload > 0 and layer.fwd["offload"].flops == layer.fwd["none"].flops
    # Estimated time: more recomputation, more time; offload pays the host link.
    secs = {m: layer.fwd[m].seconds + layer.bwd[m].seconds for m in prof.modes}
    assert secs["none"] < secs["selective"] <= secs["full"] and secs["offload"] > secs["none"]
    assert any("emulated" in n for n in prof.notes)


@pytest.mark.slow
def test_7b_llama_at_4096_tokens_plans_on_meta_without_allocating() -> None:
    # In a fresh interpreter so that its peak resident memory is this plan's alone. The model's
    # bf16 parameters alone would be 12.6 GiB; the step's tensors well over 60 GiB.
    script = textwrap.dedent(
        """
        import json, resource, torch
        from bench.llama_like import LlamaLike, llama_7b, token_batch
        from lightning_recompute.planner import Planner
        from lightning_recompute.profile import profile_meta
        cfg = llama_7b()
        prof = profile_meta(lambda: LlamaLike(cfg).to(torch.bfloat16), token_batch(1, 4096, cfg.vocab_size, "meta"),
                            modes=["none", "selective", "full"], hardware="H100")
        planner = Planner(prof)
        plan = planner.solve("80GiB")
        front = planner.pareto_front()
        print(json.dumps({
            "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "params": prof.param_bytes, "layers": len(prof.layers), "peak": plan.peak_bytes,
            "none_peak": planner.predict({n: "none" for n in prof.layer_names}).peak_bytes,
            "min_peak": front[0].peak_bytes, "estimated": plan.prediction.estimated, "front": len(front),
        }))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["layers"] == 32
    assert 6.5e9 * 2 < res["params"] < 7.0e9 * 2  # ~6.7B bf16 parameters, on paper
    assert res["maxrss"] < 1.5 * 2**30, f"resident memory {res['maxrss'] / 2**30:.2f} GiB: something was allocated"
    assert res["estimated"]
    assert res["min_peak"] <= res["peak"] <= 80 * 2**30 < res["none_peak"] or res["none_peak"] <= 80 * 2**30
    assert res["front"] >= 2


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ProfileError, match="unknown mode 'fast'; valid modes are: none, selective, full, offload"):
        profile_model(_gpt(), _batch(), modes=["fast"])
    with pytest.raises(ProfileError, match="repeats: must be a positive integer, got 0"):
        profile_model(_gpt(), _batch(), repeats=0)
    with torch.device("meta"):
        meta_model = _gpt()
    with pytest.raises(ProfileError, match="use profile_meta"):
        profile_model(meta_model, _batch())
    with pytest.raises(ProfileError, match=f"hardware: unknown 'B200'; valid: {', '.join(HARDWARE)}"):
        profile_meta(_gpt, _batch(), hardware="B200")
    with pytest.raises(ProfileError, match="mfu: must be in"):
        profile_meta(_gpt, _batch(), mfu=2.0)


def test_a_mode_that_does_not_fit_is_profiled_in_groups_of_layers_with_the_same_costs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a device where keeping every activation runs out of memory, the profile measures ``none`` one
    group of layers at a time (the rest full), and every cost equals the profile of a device that fits it;
    the planner's prediction of each group's step equals that step's measured peak."""
    from lightning_recompute.meter import CPU_MEMORY_LIMIT
    from lightning_recompute.planner import Planner
    from lightning_recompute.reference import ReferenceGPT, SyntheticTokens

    torch.manual_seed(0)
    model = ReferenceGPT(vocab_size=64, seq_len=64, n_layer=4, n_embd=32, n_head=4, dropout=0.1)
    batch = next(iter(SyntheticTokens(vocab_size=64, seq_len=64, batch_size=4, num_batches=1).train_dataloader()))
    modes = ["none", "selective", "full"]
    # The previous step's gradients alive in the forward, as in the profile's own steps (Lightning's order).
    whole = profile_model(model, batch, modes=modes, repeats=1, free_grads_at_batch_start=False)
    planner = Planner(whole)
    none_peak = planner.predict(RecomputePolicy.uniform("none")).peak_bytes
    full_peak = planner.predict(RecomputePolicy.uniform("full")).peak_bytes
    monkeypatch.setenv(CPU_MEMORY_LIMIT, str((none_peak + full_peak) // 2))

    from lightning_recompute.profile.measure import Metered, ProfilingRun

    runs: list[Metered] = []
    real = ProfilingRun.metered
    monkeypatch.setattr(ProfilingRun, "metered", lambda self, *a: runs.append(real(self, *a)) or runs[-1])
    capped = profile_model(model, batch, modes=modes, repeats=1, free_grads_at_batch_start=False)

    assert whole.split == {} and capped.split == {"none": 4}  # halves do not fit either: one layer at a time
    assert any("none: does not fit with every layer in it" in n for n in capped.notes)
    for a, b in zip(whole.layers, capped.layers, strict=True):
        for phase in ("fwd", "bwd"):
            for m in modes:
                x, y = getattr(a, phase)[m], getattr(b, phase)[m]
                assert (x.delta, x.peak, x.grad, x.flops) == (y.delta, y.peak, y.grad, y.flops), (a.name, phase, m)
    assert {k: (c.delta, c.peak) for k, c in whole.fixed.items()} == {
        k: (c.delta, c.peak) for k, c in capped.fixed.items()
    }
    assert Planner(capped).predict(RecomputePolicy.uniform("none")).peak_bytes == none_peak
    (split,) = [run for run in runs if len(run.groups) > 1]
    for policy, rec in zip(split.policies, split.runs, strict=True):
        measured = max(e.peak for e in rec.events)
        assert Planner(capped).predict(policy).peak_bytes == measured
    assert Profile.from_dict(capped.to_dict()).split == {"none": 4}


def test_a_model_that_does_not_fit_even_fully_recomputed_is_an_out_of_memory_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning_recompute.meter import CPU_MEMORY_LIMIT
    from lightning_recompute.reference import ReferenceGPT, SyntheticTokens

    model = ReferenceGPT(vocab_size=64, seq_len=64, n_layer=2, n_embd=32, n_head=4)
    batch = next(iter(SyntheticTokens(vocab_size=64, seq_len=64, batch_size=4, num_batches=1).train_dataloader()))
    monkeypatch.setenv(CPU_MEMORY_LIMIT, "1MiB")
    with pytest.raises(torch.OutOfMemoryError, match="does not fit on cpu even with every layer in full"):
        profile_model(model, batch, modes=["none", "full"], repeats=1)
