"""Where a policy comes from: `as_policy` turns what the entry points accept (`PolicyLike`) into a `RecomputePolicy`."""

from __future__ import annotations

import os
from collections.abc import Mapping

from lightning_recompute.errors import PolicyError, clip
from lightning_recompute.policy import PolicyLike, RecomputePolicy

MLFLOW_PREFIX = "mlflow:"


def as_policy(policy: PolicyLike) -> RecomputePolicy:
    """The `RecomputePolicy` that ``policy`` names; a `PolicyError` when it holds none or is of another type."""
    if isinstance(policy, RecomputePolicy):
        return policy
    if isinstance(policy, Mapping):
        return RecomputePolicy.from_dict(policy)
    if isinstance(policy, str) and policy.startswith(MLFLOW_PREFIX):
        from lightning_recompute.mlflow_policy import load_good_policy

        experiment, _, tracking_uri = policy[len(MLFLOW_PREFIX) :].partition("@")
        if not experiment:
            raise PolicyError(
                f"policy: {clip(repr(policy))} names no experiment; expected 'mlflow:<experiment>[@<tracking uri>]'"
            )
        return load_good_policy(experiment, tracking_uri or None)
    if isinstance(policy, (str, os.PathLike)):
        return RecomputePolicy.load(policy)
    raise PolicyError(
        f"policy: expected a RecomputePolicy, a mapping, a path to a policy file or 'mlflow:<experiment>', "
        f"got {type(policy).__name__}"
    )
