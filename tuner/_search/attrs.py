"""The keys of the study's user attributes: the study's own record, shared by every worker.

These names are the store layout: a study written by an earlier version resumes only while they
stay the same. `tuner._search.study.TuningStudy` is the only reader and writer; the session goes
through its methods.
"""

from __future__ import annotations

__all__ = ["StudyAttr", "TrialAttr"]


class StudyAttr:
    """Keys of ``study.user_attrs``: what the session that created the study recorded once."""

    SEARCH_SPACE = "search_space"
    """`SearchSpace.signature` of the creator: a session with another space may not join."""
    BUDGET_BYTES = "budget_bytes"
    """The budget limit the study was tuned for: a session with another may not join."""
    RECIPE = "recipe"
    RECIPE_FINGERPRINT = "recipe_fingerprint"
    DEVICE = "device"
    SEEDED = "seeded"
    """Seeding happened, once, by the session that set the study up."""
    ABANDONED = "setup_abandoned"
    """The creator was stopped before seeding: a waiting worker takes the setup over."""
    PROFILE = "profile"
    """`Profile.to_dict` of the model: resumed and joining sessions predict with the same figures."""
    PLANNER_NOTE = "planner_note"
    """Why the planner made no predictions, or what it could not do."""
    SETUP_OWNER = "setup_owner"
    """`tuner._liveness.Owner.to_dict` of the session setting the study up: a dead one is taken over."""
    SETUP_HEARTBEAT = "setup_heartbeat"
    """The setting-up session's last heartbeat (``time.time()``)."""


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
    NOISE_REL = "step_time_mad_rel"
    """The trial's step times' median absolute deviation over their median (absent in older studies)."""
    WALL_S = "wall_s"
    DUPLICATE_OF = "duplicate_of"
    OWNER = "owner"
    """`tuner._liveness.Owner.to_dict` of the session running the trial."""
    HEARTBEAT = "heartbeat"
    """The owner's last heartbeat while the trial runs (``time.time()``)."""
    SESSION_RUN = "session_run_id"
    """The MLflow session run of the owner: where the trial's run goes if the owner dies."""
    CLAIMED = "claimed"
    """Set when the trial's worker has decided to measure it (`TuningStudy.claim`)."""
    RETRY_OF = "retry_of"
    """The number of the trial whose owner died, for a candidate enqueued again."""
