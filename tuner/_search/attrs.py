"""The keys of the study's and its trials' user attributes: the store layout (a study written by an earlier
version resumes only while they stay the same), read and written by `tuner._search.study` (the setup's profile
and planner note by `tuner.session`, the heartbeats by `tuner._workers`)."""

from __future__ import annotations


class StudyAttr:
    """Keys of ``study.user_attrs``: what the session that created the study recorded once."""

    SEARCH_SPACE = "search_space"  # `SearchSpace.signature`: a session with another space may not join
    BUDGET_BYTES = "budget_bytes"  # a session with another budget limit may not join
    RECIPE = "recipe"
    RECIPE_FINGERPRINT = "recipe_fingerprint"
    DEVICE = "device"
    SEEDED = "seeded"
    ABANDONED = "setup_abandoned"  # the creator stopped before seeding: a waiting worker takes the setup over
    PROFILE = "profile"  # `Profile.to_dict`: joining sessions predict with the same figures
    PLANNER_NOTE = "planner_note"
    SETUP_OWNER = "setup_owner"  # `tuner._liveness.Owner.to_dict` of the session setting the study up
    SETUP_HEARTBEAT = "setup_heartbeat"


class TrialAttr:
    """Keys of ``trial.user_attrs``: each trial's record (read back by `TuningStudy.records`)."""

    OUTCOME = "outcome"
    CANDIDATE_KEY = "candidate_key"
    SEED = "seed"
    SEED_KEY = "seed_key"
    PEAK_OVER = "peak_minus_budget"
    POLICY = "policy"
    FINGERPRINT = "policy_fingerprint"
    SHORT = "policy_short"
    MICRO_BATCH = "micro_batch"
    WORKER = "worker"
    RUN_ID = "mlflow_run_id"
    REASON = "reason"
    PREDICTED_PEAK_BYTES = "predicted_peak_bytes"
    PREDICTED_STEP_TIME_S = "predicted_step_time_s"
    THROUGHPUT = "throughput"
    THROUGHPUT_UNIT = "throughput_unit"
    PEAK_BYTES = "peak_bytes"
    STEP_TIME_S = "step_time_s"
    NOISE_REL = "step_time_mad_rel"  # absent in older studies
    WALL_S = "wall_s"
    DUPLICATE_OF = "duplicate_of"
    OWNER = "owner"  # `tuner._liveness.Owner.to_dict` of the session running the trial
    HEARTBEAT = "heartbeat"
    SESSION_RUN = "session_run_id"  # the owner's MLflow session run: where the trial's run goes if it dies
    CLAIMED = "claimed"  # the trial's worker decided to measure it (`TuningStudy.claim`)
    RETRY_OF = "retry_of"  # for a candidate enqueued again: the trial whose owner died
