"""The autotuning service around training jobs: it finds, by measurement, the fastest per-layer
recomputation policy that fits a memory budget, and records the decision in MLflow.

The pipeline, one subpackage or module per step (docs/ARCHITECTURE.md has the full map)::

    recipe    the YAML recipe: schema, checks, load, build the model and data
    profile   per-layer costs of one training step, per recompute mode
    planner   cost model and exact solver; the seeds it gives the search
    search    the Optuna study: space, baselines, ask/tell, records
    trials    one measurement in a fresh subprocess (trials, numerics, device, profile)
    tracking  MLflow: session and trial runs, the good-policy registry, reports
    gate      confirm, check numerics, compare with the good policy; promote or reject

`session` runs the loop (`recompute-tune RECIPE`), `commands` the other subcommands, and `cli`
only parses and prints.
"""
