"""The autotuning service around training jobs: it finds, by measurement, the fastest per-layer
recomputation policy that fits a memory budget, and records the decision in MLflow (docs/ARCHITECTURE.md
has the map: `cli` parses and prints, `session` runs the loop, `_commands` the other subcommands)."""
