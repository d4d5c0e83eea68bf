"""What `AutoRecompute` races when it profiles the job: the planner's front within the limit, filled up
with the uniform policies predicted to fit when a noisy profile collapses the front."""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_recompute.auto.callback import planner_candidates
from lightning_recompute.planner import Planner
from lightning_recompute.profile import Profile, profile_model
from lightning_recompute.reference import ReferenceGPT

MODES = ["none", "selective", "full"]


@pytest.fixture(scope="module")
def flat_profile() -> Profile:
    """A real profile of a 3-layer GPT whose clock ticks once per reading: every mode takes the same
    time, as when a profile's one timed step per mode lands in noise, so the least-memory policy
    alone is on the front (as fast as the others, with a lower peak)."""
    torch.manual_seed(0)
    model = ReferenceGPT(vocab_size=64, seq_len=32, n_layer=3, n_embd=32, n_head=4, dropout=0.1, attention="eager")
    x = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    ticks = itertools.count()
    return profile_model(model, (x, x.roll(-1, 1)), modes=MODES, repeats=1, clock=lambda: float(next(ticks)))


def test_a_collapsed_front_is_filled_with_the_uniform_policies_predicted_to_fit(flat_profile: Profile) -> None:
    planner = Planner(flat_profile)
    front = planner.pareto_front(MODES)
    assert len(front) == 1 and set(front[0].short()) == {"F"}  # what the job raced before: full alone
    peaks = {m: planner.predict({lp.name: m for lp in flat_profile.layers}).peak_bytes for m in MODES}
    assert peaks["full"] < peaks["selective"] < peaks["none"]

    found, note = planner_candidates(flat_profile, peaks["none"], MODES, most=4)
    assert note is None
    assert [(c.short, c.label) for c in found] == [
        ("FFF", "planner:budget"),
        ("sss", "baseline:selective"),
        ("...", "baseline:none"),
    ]  # safest first; full is the front's point, not raced twice
    assert [c.predicted_peak_bytes for c in found] == [peaks["full"], peaks["selective"], peaks["none"]]

    # Only what is predicted to fit the limit is added, and no more than `most` race.
    found, _ = planner_candidates(flat_profile, peaks["none"] - 1, MODES, most=4)
    assert [c.short for c in found] == ["FFF", "sss"]
    found, _ = planner_candidates(flat_profile, peaks["none"], MODES, most=2)
    assert [c.short for c in found] == ["FFF", "sss"]
    # Nothing predicted to fit: the least-memory policy alone, and the note says so.
    found, note = planner_candidates(flat_profile, peaks["full"] - 1, MODES, most=4)
    assert [c.short for c in found] == ["FFF"] and note is not None and "racing only the least-memory" in note
