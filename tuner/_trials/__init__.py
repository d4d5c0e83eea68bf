"""Measurements in a child process (trials, races, numerics checks, device queries, profiles): the parent
(`runner`) writes a spec (`protocol`), runs the child (`worker`) in its own process group with a deadline and
reads the one result it writes, so that whatever the model does ends that process only."""

from tuner._trials.runner import (
    NumericsResult,
    Outcome,
    TrialResult,
    check_numerics,
    clean_stale_trial_dirs,
    device_info,
    merge_ranks,
    profile_recipe,
    run_race,
    run_trial,
    summarize_steps,
)

__all__ = [
    "NumericsResult",
    "Outcome",
    "TrialResult",
    "check_numerics",
    "clean_stale_trial_dirs",
    "device_info",
    "merge_ranks",
    "profile_recipe",
    "run_race",
    "run_trial",
    "summarize_steps",
]
