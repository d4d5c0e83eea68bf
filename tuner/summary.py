"""What a tuning session reports: each trial as it finishes (`TrialEvent`), and the session's `SessionSummary`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_recompute.tuned_for import TunedFor, batch_advice
from lightning_recompute.units import jsonable
from tuner.recipe._build import data_batch_size

if TYPE_CHECKING:
    from lightning_recompute.race import RaceResult
    from tuner._search import SearchSpace, TrialRecord, TuningStudy
    from tuner.recipe import Recipe

__all__ = ["SessionSummary", "TrialEvent", "summarize", "training_change"]


@dataclass(frozen=True)
class TrialEvent:
    """A trial just told to Optuna, the study's best feasible trial so far (any worker's), the trials run so far."""

    record: TrialRecord
    best: TrialRecord | None
    ran: int
    n_trials: int
    budget_bytes: int
    layer_names: tuple[str, ...]


@dataclass
class SessionSummary:
    """What a tuning session did and decided; ``records`` holds every finished trial of the study (all sessions and
    workers), ``gains`` the race winner's throughput over each baseline's minus 1 (``None``: not raced)."""

    recipe: str
    study: str
    storage: str
    device: str
    budget_bytes: int
    layer_names: tuple[str, ...]
    search_space: str
    status: str
    """``promoted``, ``current`` (the best is already the good policy), ``searched`` (search only),
    ``rejected`` (the gate kept the current policy), ``infeasible`` or ``interrupted``."""
    exit_code: int
    trials_this_session: int = 0
    records: list[TrialRecord] = field(default_factory=list)
    best: TrialRecord | None = None
    baselines: dict[str, TrialRecord] = field(default_factory=dict)
    gains: dict[str, float | None] = field(default_factory=dict)
    race: RaceResult | None = None
    chosen: bool = False  # `best` is the race's winner (or an earlier race's good policy), not the fastest trial
    reasons: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    policy_path: Path | None = None  # the file written, or holding the good policy
    tracking_uri: str = ""
    experiment: str = ""
    session_run_id: str | None = None
    decision_run_id: str | None = None
    notes: list[str] = field(default_factory=list)
    data_batch_size: int | None = None  # what ``micro_batch`` ``None`` means
    confidence: float = 0.95
    tuned_for: TunedFor | None = None

    @property
    def training_change(self) -> str | None:
        return training_change(self.tuned_for)

    @property
    def mlflow_command(self) -> str:
        return f"mlflow ui --backend-store-uri {self.tracking_uri}"

    def vs_figures(self) -> dict[str, dict[str, Any]]:
        """Baseline name -> the race's figure against it: ``gain``, ``low``, ``high`` (fractions), ``rounds``,
        ``confidence`` (the level ``text`` states) and ``text`` (`format_gain`)."""
        from lightning_recompute.race import format_gain

        race = self.race if self.race is not None and self.race.ok else None
        ivs = {name: race.vs.get(rec.fingerprint) for name, rec in self.baselines.items()} if race else {}
        return {
            name: {
                **dict(zip(("gain", "low", "high"), iv.gain(), strict=True)),
                "rounds": iv.rounds,
                "confidence": iv.stated(self.confidence),
                "text": format_gain(iv, self.confidence),
            }
            for name, iv in ivs.items()
            if iv is not None
        }

    @property
    def ranked(self) -> list[TrialRecord]:
        """Measured trials: feasible ones first, each group by throughput, highest first."""
        rows = [r for r in self.records if r.measured and r.throughput is not None]
        return sorted(rows, key=lambda r: (not r.feasible, -(r.throughput or 0.0), r.number))

    def to_dict(self) -> dict[str, Any]:
        """Plain types; the records as ``trials``."""
        out = {f.name: jsonable(getattr(self, f.name)) for f in fields(self) if f.name != "records"}
        extra = {"vs": self.vs_figures(), "mlflow_command": self.mlflow_command, "trials": jsonable(self.records)}
        return {**out, **extra, "training_change": self.training_change}


def training_change(tuned: TunedFor | None) -> str | None:
    """What a training job with the recipe's data must set for a policy tuned as ``tuned`` to fit: a batch
    no larger than the tuned micro-batch, with gradient accumulation keeping the data's global batch."""
    if tuned is None or tuned.micro_batch is None:
        return None
    mb, data = tuned.micro_batch, tuned.data_batch_size
    if data is None:
        return f"train at batch_size={mb} per device (the micro-batch the policy was measured at) or smaller"
    if mb == data:
        return f"no change: the policy was tuned at the data's batch size of {data}"
    if mb < data:
        size, steps = batch_advice(mb, data)
        return (
            f"set batch_size={size}, accumulate_grad_batches={steps} in the training job to keep the global batch "
            f"of {data}; at batch size {data} the policy was not measured and may not fit the budget"
        )
    return (
        f"set batch_size={mb} in the training job (the policy was tuned at micro-batch {mb}, larger than the "
        f"data's {data}: a global batch of {mb}, so revisit the learning rate); at {data} it uses less memory "
        f"and fits too, but that is not the combination measured fastest"
    )


def summarize(
    recipe: Recipe,
    source: TuningStudy | None,
    status: str,
    exit_code: int,
    *,
    study: str,
    device: str,
    budget_bytes: int,
    space: SearchSpace,
    ran: int,
    session_run_id: str | None,
    notes: list[str],
    race: RaceResult | None = None,
    chosen: str | None = None,
) -> SessionSummary:
    """The summary of a session on the study ``source`` as it ends. ``chosen``: the fingerprint the race chose
    (its trial, if one ran it, is the best); ``notes`` is kept as the very list (later notes still reach it)."""
    records = source.records() if source is not None else []
    best = source.best() if source is not None else None
    if chosen is not None:
        best = next((r for r in records if r.ran and r.fingerprint == chosen), best)
    summary = SessionSummary(
        recipe=recipe.name,
        study=study,
        storage=str(recipe.study.storage),
        device=device,
        budget_bytes=budget_bytes,
        layer_names=space.layer_names,
        search_space=space.describe(),
        status=status,
        exit_code=exit_code,
        trials_this_session=ran,
        records=records,
        best=best,
        baselines=baselines(records),
        tracking_uri=recipe.tracking.uri,
        experiment=str(recipe.tracking.experiment),
        session_run_id=session_run_id,
        notes=notes,
        data_batch_size=data_batch_size(recipe),
        race=race,
        chosen=chosen is not None and best is not None and best.fingerprint == chosen,
        confidence=recipe.race.confidence,
    )
    # "vs" figures come from the race only: two single trials minutes apart compare the machine's moments.
    figures = summary.vs_figures()
    summary.gains = {name: figures.get(name, {}).get("gain") for name in summary.baselines}
    return summary


def baselines(records: Sequence[TrialRecord]) -> dict[str, TrialRecord]:
    """Each baseline's trial: the measured one (a re-queued seed may have an interrupted record too), or, for a
    duplicate, the trial it duplicated."""
    by_number, dead = {r.number: r for r in records}, ("interrupted", "abandoned")
    out: dict[str, TrialRecord] = {}
    for r in records:
        name = r.baseline
        if r.outcome == "duplicate" and r.duplicate_of in by_number:
            r = by_number[r.duplicate_of]
        if name is not None and (name not in out or (r.outcome not in dead and out[name].outcome in dead)):
            out[name] = r
    return out


def why_infeasible(summary: SessionSummary, budget: int) -> str:
    """Why there is no best trial, consistent with the "N trials run" count the report prints."""
    if summary.ranked:
        return f"no measured trial fits the budget limit of {budget} bytes"
    ran = [r for r in summary.records if r.ran]
    if not ran:
        return "no trial was measured"
    outcomes = ", ".join(f"{n} {o}" for o, n in sorted(Counter(r.outcome for r in ran).items()))
    return f"none of the {len(ran)} trials run gave a throughput ({outcomes}); see each trial's reason"
