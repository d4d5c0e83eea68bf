"""``recompute-tune plan --max-seq-len``: the predicted longest sequence of each family fits when a
real training step is measured there (the callback's exact CPU ledger), and one step longer does not.

The step (granularity) is 8 tokens. The search profiles on the meta device (memory there is what the
CPU ledger counts, with nothing allocated and no timing runs, so it is cheap); the check trains on CPU.
"""

from __future__ import annotations

from typing import Any

import pytest

from lightning_recompute import RecomputeError, step_peak
from lightning_recompute.planner import Planner
from lightning_recompute.planner.seqlen import BEST_MIXED, longest_fits
from tuner import _commands as commands
from tuner.recipe import Recipe, build_datamodule, build_model, from_dict
from tuner.recipe._profile import profile_recipe_meta

STEP = 8
BUDGET = 1_900_000  # bytes: between the peaks of every family at 8 and at 256 tokens


def _recipe(**model_args: Any) -> Recipe:
    return from_dict(
        {
            "name": "seqlen",
            "model": {
                "class_path": "lightning_recompute.reference.ReferenceGPT",
                "init_args": {"vocab_size": 32, "seq_len": 32, "n_layer": 2, "n_embd": 16, "n_head": 2, **model_args},
            },
            "data": {"init_args": {"batch_size": 2, "num_batches": 2}},
            "budget": {"value": BUDGET, "margin": 0.0},
            "search": {"modes": ["none", "full"], "n_trials": 2},
        }
    )


@pytest.mark.slow
def test_the_predicted_longest_sequence_fits_when_measured_and_one_step_more_does_not() -> None:
    recipe = _recipe()
    summary = commands.max_seq_len(recipe, meta="H100", step=STEP, cap=256)
    by_family = {f.family: f for f in summary.fits}
    assert list(by_family) == ["none", "full", BEST_MIXED] and summary.set_on == ("model", "data")
    assert summary.budget_bytes == BUDGET
    none, full, best = by_family["none"], by_family["full"], by_family[BEST_MIXED]
    for fit in (none, full, best):
        assert fit.seq_len is not None and fit.plan is not None and not fit.capped, fit
        assert fit.seq_len % STEP == 0 and fit.plan.peak_bytes <= BUDGET and fit.tokens_per_s
    # Recomputing buys context: full reaches further than none, and the best mix at least as far as either.
    assert none.seq_len < full.seq_len <= best.seq_len
    for fit in (none, best):
        assert fit.seq_len is not None and fit.plan is not None
        at, _ = commands.with_seq_len(recipe, "seq_len", fit.seq_len)
        assert step_peak(build_model(at), build_datamodule(at), fit.plan.policy, layers=at.layers) <= BUDGET
        longer, _ = commands.with_seq_len(recipe, "seq_len", fit.seq_len + STEP)
        if fit.family == BEST_MIXED:
            # One step longer nothing fits: even the policy of least predicted peak there measures over.
            least = Planner(profile_recipe_meta(longer, None, "H100")).pareto_front(["none", "full"])[0].policy
        else:
            least = fit.plan.policy
        assert step_peak(build_model(longer), build_datamodule(longer), least, layers=longer.layers) > BUDGET


def test_a_recipe_without_the_argument_and_bad_search_bounds_are_clear_errors() -> None:
    recipe = _recipe()
    with pytest.raises(
        RecomputeError, match=r"neither model .*ReferenceGPT nor data .*takes an argument named 'context'"
    ):
        commands.max_seq_len(recipe, seq_arg="context")
    with pytest.raises(ValueError, match="step: must be a positive sequence length, got 0"):
        longest_fits(lambda n: pytest.fail("nothing to profile"), 1, modes=["none"], start=8, step=0, cap=64)
