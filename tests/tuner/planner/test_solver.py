"""The planner: the DP equals brute force, budgets are respected exactly, more budget is never
slower, and predicted peaks match the CPU meter on the reference model."""

from __future__ import annotations

import copy
import itertools
from typing import Literal

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_recompute import RecomputeError, RecomputePolicy, step_peak
from lightning_recompute.planner import BudgetError, Planner, PlannerError, format_front
from lightning_recompute.profile import LayerProfile, Profile, SegmentCost, profile_model
from lightning_recompute.reference import ReferenceGPT

# --------------------------------------------------------------------------- synthetic profiles


@st.composite
def profiles(draw: st.DrawFn, max_layers: int = 5) -> Profile:
    """Random heterogeneous profiles, fixed segments anywhere the step can have them."""
    n = draw(st.integers(1, max_layers))
    modes = [
        "none",
        *draw(st.lists(st.sampled_from(["selective", "full", "offload"]), min_size=1, max_size=3, unique=True)),
    ]
    size = st.integers(0, 1000)

    def seg(scales: bool = True) -> SegmentCost:
        return SegmentCost(
            delta=draw(st.integers(-300, 1000)),
            peak=draw(size),
            grad=0,
            seconds=draw(st.integers(0, 5000)) / 1e6,
            scales=scales,
        )

    layers = [
        LayerProfile(
            name=f"blocks.{i}",
            group="g",
            param_bytes=0,
            fwd={m: seg() for m in modes},
            bwd={m: seg() for m in modes},
            net=draw(st.integers(-200, 400)),
        )
        for i in range(n)
    ]
    timeline: list[str] = []
    fixed: dict[str, SegmentCost] = {}

    def maybe_fixed(where: str) -> None:
        if draw(st.booleans()):
            fixed[where] = seg()
            timeline.append(f"fixed:{where}")

    maybe_fixed("pre")
    for i in range(n):
        timeline.append(f"fwd:{i}")
        maybe_fixed(f"after-fwd-{i}")
    for i in reversed(range(n)):
        timeline.append(f"bwd:{i}")
        maybe_fixed(f"after-bwd-{i}")
    return Profile(
        layers=layers,
        timeline=timeline,
        fixed=fixed,
        modes=modes,
        base_bytes=draw(st.integers(0, 2000)),
        param_bytes=0,
        grad_bytes=0,
        optimizer_bytes=0,
        batch_bytes=0,
        micro_batch=1,
        device="cpu",
        time_source="measured",
    )


def _brute(planner: Planner, modes: list[str]) -> list[tuple[int, float, tuple[str, ...]]]:
    out = []
    for combo in itertools.product(modes, repeat=len(planner.names)):
        pred = planner.predict(dict(zip(planner.names, combo, strict=False)))
        out.append((pred.peak_bytes, pred.step_time_s, combo))
    return out


@settings(max_examples=150, deadline=None)
@given(profiles(), st.data())
def test_dp_equals_brute_force_and_respects_budget(profile: Profile, data: st.DataObject) -> None:
    planner = Planner(profile)
    everything = _brute(planner, profile.modes)
    least = min(p for p, _, _ in everything)
    assert planner.min_peak() == least
    peaks = sorted({p for p, _, _ in everything})
    budgets = peaks + [p - 1 for p in peaks] + [data.draw(st.integers(least - 50, max(peaks) + 50))]
    for budget in (b for b in budgets if b >= 0):
        feasible = [t for p, t, _ in everything if p <= budget]
        if not feasible:
            with pytest.raises(BudgetError, match=f"least achievable predicted peak .*\\({least} bytes\\)") as err:
                planner.solve(budget)
            assert (err.value.budget_bytes, err.value.min_peak_bytes) == (budget, least)  # for a caller's retry
            continue
        plan = planner.solve(budget)
        assert plan.peak_bytes <= budget
        assert plan.step_time_s == min(feasible)
        assert plan.prediction == planner.predict(plan.policy)


@settings(max_examples=100, deadline=None)
@given(profiles())
def test_pareto_front_equals_brute_force(profile: Profile) -> None:
    planner = Planner(profile)
    points = sorted((p, t) for p, t, _ in _brute(planner, profile.modes))
    expected, best = [], None
    for p, t in points:
        if best is None or t < best:
            best = t
            expected.append((p, t))
    front = planner.pareto_front()
    assert [(pl.peak_bytes, pl.step_time_s) for pl in front] == expected
    # solve() at each front point's peak returns that point's time: the two solvers agree.
    for pl in front:
        assert planner.solve(pl.peak_bytes).step_time_s == pl.step_time_s


@settings(max_examples=60, deadline=None)
@given(profiles(), st.lists(st.integers(0, 12000), min_size=2, max_size=8))
def test_more_budget_is_never_slower(profile: Profile, budgets: list[int]) -> None:
    planner = Planner(profile)
    times = []
    for budget in sorted(budgets):
        try:
            times.append(planner.solve(budget).step_time_s)
        except BudgetError:
            assert not times, "a budget failed after a smaller one succeeded"
    assert times == sorted(times, reverse=True)


def test_solver_is_deterministic_for_100_heterogeneous_layers() -> None:
    # How long this takes is a figure for bench/, not a test: a loaded machine would fail any bound.
    g = torch.Generator().manual_seed(0)

    def r(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=g))

    modes = ["none", "selective", "full", "offload"]
    layers = []
    for i in range(100):
        kept = {
            "none": r(800, 1200) * 1000,
            "selective": r(300, 500) * 1000,
            "full": r(30, 60) * 1000,
            "offload": r(0, 20) * 1000,
        }
        secs = {
            "none": 1.0,
            "selective": 1.05 + r(0, 5) / 100,
            "full": 1.3 + r(0, 10) / 100,
            "offload": 1.2 + r(0, 10) / 100,
        }
        layers.append(
            LayerProfile(
                f"layers.{i}",
                "g",
                0,
                fwd={m: SegmentCost(delta=kept[m], peak=kept[m] + 1000, seconds=secs[m] / 3) for m in modes},
                bwd={
                    m: SegmentCost(peak=(1_000_000 if m == "full" else 200_000), seconds=2 * secs[m] / 3) for m in modes
                },
                net=5000,
            )
        )
    timeline = [f"fwd:{i}" for i in range(100)] + [f"bwd:{i}" for i in reversed(range(100))]
    prof = Profile(layers, timeline, {}, modes, 10**9, 0, 0, 0, 0, 1, "cpu", "measured")
    planner = Planner(prof)
    least = planner.min_peak()
    budget = least + (planner.predict(RecomputePolicy.uniform("none")).peak_bytes - least) // 3
    plan = planner.solve(budget)
    assert plan.peak_bytes <= budget
    assert planner.solve(budget).modes == plan.modes  # deterministic
    assert plan.step_time_s <= planner.predict(RecomputePolicy.uniform("full")).step_time_s


# --------------------------------------------------------------------------- inputs


def test_a_budget_that_is_not_a_size_is_a_planner_error() -> None:
    seg = SegmentCost(delta=1000, peak=1000, seconds=1e-3)
    layer = LayerProfile("blocks.0", "g", 0, fwd={"none": seg, "full": seg}, bwd={"none": seg, "full": seg}, net=0)
    planner = Planner(Profile([layer], ["fwd:0", "bwd:0"], {}, ["none", "full"], 100, 0, 0, 0, 0, 1, "cpu", "measured"))
    for bad in ("20 gigs", "", "GiB", "-1GiB", "0GiB", True, None):
        with pytest.raises(PlannerError, match="budget_bytes"):
            planner.solve(bad)  # type: ignore[arg-type]
    assert planner.solve("20GiB").peak_bytes == planner.solve(20 * 2**30).peak_bytes
    for below_every_peak in (0, -5):
        with pytest.raises(BudgetError, match="below the least achievable predicted peak"):
            planner.solve(below_every_peak)
    assert issubclass(BudgetError, RecomputeError)


# --------------------------------------------------------------------------- the reference model

B, T = 4, 32


def _model(attention: Literal["eager", "sdpa"]) -> ReferenceGPT:
    torch.manual_seed(0)
    return ReferenceGPT(vocab_size=64, seq_len=T, n_layer=4, n_embd=32, n_head=4, dropout=0.1, attention=attention)


@pytest.fixture(scope="module")
def eager_profile() -> tuple[ReferenceGPT, tuple[torch.Tensor, torch.Tensor], Profile]:
    model = _model("eager")
    x = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1))
    batch = (x, x.roll(-1, 1))
    prof = profile_model(
        model, batch, modes=["none", "selective", "full"], repeats=1, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)
    )
    return model, batch, prof


@pytest.mark.parametrize("glyphs", ["....", "FFFF", "ssss", "F.s.", "Fs..", "sF.F", ".FsF", "FFs."])
def test_predicted_peak_matches_the_cpu_meter_within_5_percent(eager_profile, glyphs: str) -> None:
    model, batch, prof = eager_profile
    names = prof.layer_names
    policy = RecomputePolicy.from_modes(
        {n: {".": "none", "s": "selective", "F": "full"}[g] for n, g in zip(names, glyphs, strict=False)}
    )
    predicted = Planner(prof).predict(policy).peak_bytes
    measured = step_peak(copy.deepcopy(model), [batch, batch], policy)
    assert abs(predicted - measured) <= 0.05 * measured, (glyphs, predicted, measured)


def test_solved_policy_fits_the_budget_when_measured(eager_profile) -> None:
    model, batch, prof = eager_profile
    planner = Planner(prof)
    least = planner.min_peak()
    none_peak = planner.predict(RecomputePolicy.uniform("none")).peak_bytes
    budget = least + (none_peak - least) // 2
    plan = planner.solve(budget)
    assert plan.peak_bytes <= budget
    assert step_peak(copy.deepcopy(model), [batch, batch], plan.policy) <= budget * 1.05
    front = planner.pareto_front()
    assert front[0].peak_bytes == least and front[-1].step_time_s == min(p.step_time_s for p in front)
    table = format_front(front, {"budget": budget})
    assert "fits" in table and len(table.splitlines()) == len(front) + 2
    with pytest.raises(BudgetError, match=f"below the least achievable predicted peak .*{least} bytes"):
        planner.solve(least - 1)


def test_predict_rejects_modes_the_profile_lacks_and_bad_micro_batch(eager_profile) -> None:
    _, _, prof = eager_profile
    planner = Planner(prof)
    with pytest.raises(PlannerError, match=r"offload.*profiled: none, selective, full"):
        planner.predict(RecomputePolicy.uniform("offload"))
    with pytest.raises(PlannerError, match="micro_batch: must be a positive integer, got 0"):
        planner.predict(RecomputePolicy.uniform("none"), micro_batch=0)
    with pytest.raises(PlannerError, match="modes: 'bogus' is not in the profile"):
        planner.solve("1GiB", modes=["bogus"])


def test_micro_batch_scaling_predicts_a_larger_batch_within_5_percent(eager_profile) -> None:
    model, _, prof = eager_profile
    x = torch.randint(0, 64, (2 * B, T), generator=torch.Generator().manual_seed(2))
    big = (x, x.roll(-1, 1))
    planner = Planner(prof)
    for glyphs in ("....", "FF..", "ssFF"):
        policy = RecomputePolicy.from_modes(
            {n: {".": "none", "s": "selective", "F": "full"}[g] for n, g in zip(prof.layer_names, glyphs, strict=False)}
        )
        predicted = planner.predict(policy, micro_batch=2 * B)
        measured = step_peak(copy.deepcopy(model), [big, big], policy)
        assert predicted.micro_batch == 2 * B
        assert abs(predicted.peak_bytes - measured) <= 0.05 * measured, (glyphs, predicted.peak_bytes, measured)
