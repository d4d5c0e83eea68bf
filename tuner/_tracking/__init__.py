"""MLflow records of tuning: session runs, trial runs, and the good-policy decisions.

Layout (one experiment per recipe; everything the tuner decides can be read back from MLflow):

- **session run** (tag ``recompute.kind=session``, ``recompute.study=<study>``): the recipe
  (``recipe.yaml`` + its settings as ``recipe.*`` params), and at the end the best policy
  (``best_policy.yaml``, ``best.json``), the trials table (``trials.json``, ``trials.csv``),
  the baselines (``baselines.json``) and the Pareto plot (``pareto.png``); a markdown summary as
  the run's description.
- **trial run**, nested in the session (``recompute.kind=trial``, ``recompute.outcome=<outcome>``):
  one ``layer.<path>`` param per layer (its mode), ``micro_batch``, ``policy_fingerprint``,
  ``trial_number``; ``measured_*`` and ``predicted_*`` metrics; ``policy.yaml``.
- **confirmation run** (``recompute.kind=confirmation``): the evidence gate's long run, same shape.
- **decision run** (``recompute.kind=decision``, ``recompute.decision=promote|reject|rollback``):
  ``recompute.reason``, ``recompute.previous_good_run_id``, ``recompute.new_good_run_id``,
  ``recompute.decision_seq``; artifacts ``policy.yaml`` and ``evidence.json``.
- the **experiment tag** ``recompute.good_run_id`` names the run holding the current good policy
  (what `lightning_recompute.mlflow_policy.load_good_policy` reads); that run carries
  ``recompute.good=true``.

Every call names its run by id through `mlflow.MlflowClient`; nothing uses MLflow's global
active run, so a resumed session, a gate run after it, and several workers in one process or many
do not step on each other.

Modules: `tuner._tracking.names` (every tag, param and artifact name), `tuner._tracking.client` (the
shared MLflow client), `tuner._tracking.sessions` (session and trial runs), `tuner._tracking.registry`
(the good policy: promote, reject, rollback, history), `tuner._tracking.report` (CSV,
markdown), `tuner._tracking.tracker` (`Tracker`: its `sessions` and `registry` sharing one `TrackingClient`).
"""

from __future__ import annotations

from tuner._tracking.client import DEFAULT_TRACKING_URI, ExperimentNotFound, TrackingError, artifact_location_for
from tuner._tracking.registry import Decision, GoodPolicy
from tuner._tracking.tracker import Tracker, open_tracker

__all__ = [
    "DEFAULT_TRACKING_URI",
    "Decision",
    "ExperimentNotFound",
    "GoodPolicy",
    "Tracker",
    "TrackingError",
    "artifact_location_for",
    "open_tracker",
]
