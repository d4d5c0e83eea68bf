"""The autotuning service around training jobs: profile, plan, search, trial, track, gate."""
