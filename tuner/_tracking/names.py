"""Every MLflow tag, param and artifact name the tuner writes: the store layout, in one place.

People filter on these in ``mlflow ui``, and the plugin reads some of them
(`lightning_recompute.mlflow_policy`): a record written by an earlier version stays readable only
while they stay the same. Only `tuner._tracking` writes them.
"""

from __future__ import annotations

from lightning_recompute.mlflow_policy import GOOD_RUN_TAG, POLICY_ARTIFACT

__all__ = [
    "BASELINES_JSON",
    "BEST_FINGERPRINT",
    "BEST_JSON",
    "BEST_POLICY_YAML",
    "BEST_RUN",
    "COMPILE_PARAM",
    "COMPILE_SECONDS_METRIC",
    "DECISION",
    "DECISION_ENDED_BY",
    "DECISION_SEQ",
    "DEVICE",
    "ERROR",
    "EVIDENCE_JSON",
    "FINGERPRINT",
    "GOOD",
    "GOOD_RUN_TAG",
    "HEARTBEAT",
    "IN_JOB",
    "KIND",
    "MACHINE_METRIC_PREFIX",
    "MICRO_BATCH_PARAM",
    "NEW_GOOD",
    "NOTE",
    "OUTCOME",
    "OWNER",
    "PARENT",
    "POLICY_ARTIFACT",
    "POLICY_FINGERPRINT_PARAM",
    "POLICY_SHORT",
    "PREVIOUS_GOOD",
    "PROMOTED",
    "PROMOTED_AT",
    "RACE_JSON",
    "RACE_SUMMARY",
    "RACE_WINNER",
    "RANK_PEAK_METRIC",
    "REASON",
    "RECIPE_CHANGED_ON_RESUME",
    "RECIPE_FINGERPRINT",
    "RECIPE_NAME",
    "RECIPE_YAML",
    "REJECTED",
    "REJECT_REASON",
    "RESUMES",
    "ROLLED_BACK",
    "SESSION_ENDED_BY",
    "SESSION_NOTES",
    "SESSION_STATUS",
    "SOURCE_RUN",
    "STDERR_TAIL_TXT",
    "STEP_NOISE_METRICS",
    "STUDY",
    "STUDY_NAME_PARAM",
    "THROUGHPUT_UNIT",
    "TRIALS_CSV",
    "TRIALS_JSON",
    "TRIAL_NUMBER_PARAM",
    "TUNED_MICRO_BATCH",
    "rank_peak_metric",
]

# ---------------------------------------------------------------------------------------------- tags

KIND = "recompute.kind"
"""``session``, ``trial``, ``confirmation`` or ``decision``."""
STUDY = "recompute.study"
OUTCOME = "recompute.outcome"
REASON = "recompute.reason"
OWNER = "recompute.owner"
"""On a session or decision run: JSON of the `tuner._liveness.Owner` running it (host, pid, start)."""
HEARTBEAT = "recompute.heartbeat"
"""On a session run: its owner's last heartbeat (``time.time()``); another host's dead owner is one that stopped."""
SESSION_ENDED_BY = "recompute.session_ended_by"
"""On a session run another process ended: why (its owner died)."""
DECISION_ENDED_BY = "recompute.decision_ended_by"
"""On a decision run another process ended: why (its owner died before the decision was recorded)."""
ERROR = "recompute.error"
DEVICE = "recompute.device"
THROUGHPUT_UNIT = "recompute.throughput_unit"
POLICY_SHORT = "recompute.policy_short"
FINGERPRINT = "recompute.policy_fingerprint"
SOURCE_RUN = "recompute.source_run_id"
DECISION = "recompute.decision"
"""``promote``, ``reject`` or ``rollback``."""
DECISION_SEQ = "recompute.decision_seq"
PREVIOUS_GOOD = "recompute.previous_good_run_id"
NEW_GOOD = "recompute.new_good_run_id"
GOOD = "recompute.good"
PROMOTED = "recompute.promoted"
PROMOTED_AT = "recompute.promoted_at"
ROLLED_BACK = "recompute.rolled_back"
REJECTED = "recompute.rejected"
REJECT_REASON = "recompute.reject_reason"
RESUMES = "recompute.resumes"
RECIPE_NAME = "recompute.recipe_name"
RECIPE_FINGERPRINT = "recompute.recipe_fingerprint"
RECIPE_CHANGED_ON_RESUME = "recompute.recipe_changed_on_resume"
SESSION_STATUS = "recompute.session_status"
SESSION_NOTES = "recompute.session_notes"
"""What the session decided without a trial (space, planner trouble, why it stopped)."""
BEST_FINGERPRINT = "recompute.best_fingerprint"
BEST_RUN = "recompute.best_run_id"
TUNED_MICRO_BATCH = "recompute.tuned_micro_batch"
"""Decision run tag: the micro-batch the decided policy was tuned for (its ``tuned_for.micro_batch``)."""
RACE_WINNER = "recompute.race_winner"
"""On a session run: the fingerprint of the policy the race chose."""
RACE_SUMMARY = "recompute.race"
"""On a session run: the race in words (winner, tie, stop reason, the "vs" figures with their intervals)."""
IN_JOB = "recompute.in_job"
"""On a session run: ``true`` when it tuned inside a training job (`lightning_recompute.auto.AutoRecompute`), not in
``recompute-tune``."""
PARENT = "mlflow.parentRunId"
NOTE = "mlflow.note.content"
"""MLflow's own tag for a run's description (markdown)."""

# ---------------------------------------------------------------------------------------------- params

STUDY_NAME_PARAM = "study_name"
TRIAL_NUMBER_PARAM = "trial_number"
MICRO_BATCH_PARAM = "micro_batch"
POLICY_FINGERPRINT_PARAM = "policy_fingerprint"
COMPILE_PARAM = "compile"
"""``true`` when the trial's policy compiles its layers (``RecomputePolicy.compile``); logged only then."""
# Also: one ``layer.<path>`` param per layer (its mode), and ``recipe.<key>`` per recipe setting.

# ---------------------------------------------------------------------------------------------- metrics

RANK_PEAK_METRIC = "measured_peak_bytes_rank"
"""Prefix of a multi-rank trial's per-rank peaks (`rank_peak_metric`); ``measured_peak_bytes`` is their maximum."""


def rank_peak_metric(rank: int) -> str:
    """The metric holding rank ``rank``'s measured peak: ``measured_peak_bytes_rank0``, ..."""
    return f"{RANK_PEAK_METRIC}{rank}"


STEP_NOISE_METRICS = ("step_time_mad_rel", "step_time_ci_rel")
"""A trial's noise: median absolute deviation of its step times over their median, and the relative width
of a 95% interval of the median (`lightning_recompute.race.stats.spread`); logged where the trial has enough steps."""
MACHINE_METRIC_PREFIX = "machine_"
"""``machine_load_1m``, ``machine_cpu_mhz``, ``machine_gpu_sm_mhz`` ...: the machine while a trial or race ran."""

COMPILE_SECONDS_METRIC = "compile_s"
"""Seconds torch.compile spent compiling a trial's layers (dynamo + inductor, forward and backward),
spent in warm-up steps outside the timed ones; logged only for trials that compile."""
# Also: ``measured_*`` and ``predicted_*`` per figure, ``wall_s``, ``step_time_s`` per step.

# ---------------------------------------------------------------------------------------------- artifacts

RECIPE_YAML = "recipe.yaml"
TRIALS_JSON = "trials.json"
TRIALS_CSV = "trials.csv"
BASELINES_JSON = "baselines.json"
BEST_POLICY_YAML = "best_policy.yaml"
BEST_JSON = "best.json"
EVIDENCE_JSON = "evidence.json"
RACE_JSON = "race.json"
STDERR_TAIL_TXT = "stderr_tail.txt"
# ``pareto.png`` is named by `tuner._plots.pareto_plot`'s output file; ``policy.yaml`` is POLICY_ARTIFACT.
