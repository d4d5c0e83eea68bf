"""The MLflow names the tuner writes (README.md, 'MLflow'): people filter on them in ``mlflow ui`` and earlier
records stay readable only while they stay the same (add, do not rename). The good run's tag and the policy
artifact are the plugin's (`lightning_recompute.mlflow_policy`)."""

from __future__ import annotations

# Tags.
KIND = "recompute.kind"  # session, trial, confirmation or decision
STUDY = "recompute.study"
OUTCOME = "recompute.outcome"
REASON = "recompute.reason"
OWNER = "recompute.owner"  # JSON of the `tuner._liveness.Owner` running a session or decision run
HEARTBEAT = "recompute.heartbeat"  # a session owner's last heartbeat (time.time())
SESSION_ENDED_BY = "recompute.session_ended_by"  # why another process ended a session run (its owner died)
DECISION_ENDED_BY = "recompute.decision_ended_by"  # the same for a decision run
ERROR = "recompute.error"
DEVICE = "recompute.device"
THROUGHPUT_UNIT = "recompute.throughput_unit"
POLICY_SHORT = "recompute.policy_short"
FINGERPRINT = "recompute.policy_fingerprint"
SOURCE_RUN = "recompute.source_run_id"
DECISION = "recompute.decision"  # promote, reject or rollback
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
SESSION_NOTES = "recompute.session_notes"  # what the session decided without a trial
BEST_FINGERPRINT = "recompute.best_fingerprint"
BEST_RUN = "recompute.best_run_id"
TUNED_MICRO_BATCH = "recompute.tuned_micro_batch"  # decision run: the decided policy's tuned_for.micro_batch
RACE_WINNER = "recompute.race_winner"
RACE_SUMMARY = "recompute.race"  # the race in words; ``recompute.race.vs.<entrant>`` per "vs" figure
IN_JOB = "recompute.in_job"  # ``true`` on a session run tuned inside a training job (AutoRecompute)
PARENT = "mlflow.parentRunId"
NOTE = "mlflow.note.content"  # MLflow's own tag for a run's description (markdown)

# Params; also one ``layer.<path>`` param per layer (its mode), and ``recipe.<key>`` per recipe setting.
STUDY_NAME_PARAM = "study_name"
TRIAL_NUMBER_PARAM = "trial_number"
MICRO_BATCH_PARAM = "micro_batch"
POLICY_FINGERPRINT_PARAM = "policy_fingerprint"
COMPILE_PARAM = "compile"  # ``true``, logged only when the policy compiles its layers


# Metrics; also ``measured_*`` and ``predicted_*`` per figure, ``wall_s``, ``step_time_s`` per step.
def rank_peak_metric(rank: int) -> str:
    """A multi-rank trial's peak of rank ``rank`` (``measured_peak_bytes`` is their maximum)."""
    return f"measured_peak_bytes_rank{rank}"


STEP_NOISE_METRICS = ("step_time_mad_rel", "step_time_ci_rel")
"""A trial's noise (`lightning_recompute.race.stats.spread`), logged where it has enough steps."""
MACHINE_METRIC_PREFIX = "machine_"  # machine_load_1m, machine_gpu_sm_mhz ...: the machine during a trial or race
COMPILE_SECONDS_METRIC = "compile_s"  # torch.compile time in the warm-up steps, for trials that compile

# Artifacts; also ``pareto.png`` (`tuner._plots.pareto_plot`) and the plugin's ``policy.yaml``.
RECIPE_YAML = "recipe.yaml"
TRIALS_JSON = "trials.json"
TRIALS_CSV = "trials.csv"
BASELINES_JSON = "baselines.json"
BEST_POLICY_YAML = "best_policy.yaml"
BEST_JSON = "best.json"
EVIDENCE_JSON = "evidence.json"
RACE_JSON = "race.json"
STDERR_TAIL_TXT = "stderr_tail.txt"
