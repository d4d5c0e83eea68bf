"""One tuning session end to end: recipe -> plan -> study -> trials -> tracking -> gate -> policy file.

`tune` is what ``recompute-tune RECIPE`` runs; `plan`, `rollback` and `history` back the other
subcommands. They return plain summary objects and report progress through callbacks, so the
CLI only parses arguments and prints.

Interrupts: `tune` handles SIGINT itself (when it runs in the main thread). The first Ctrl-C lets
the trial in flight finish, records it, and stops; the second kills the trial (its process group)
and records it as interrupted. Either way the in-flight Optuna trial is told (FAIL, and a seed
goes back in the queue), the MLflow session run is ended as KILLED, and the next run of the same
recipe resumes the study. Setting up (profiling) and the evidence gate are stopped by the first
Ctrl-C: nothing is promoted from an interrupted confirmation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_recompute.errors import RecomputeError
from lightning_recompute.policy import RecomputePolicy
from tuner.search import (
    Prediction,
    Predictor,
    Proposal,
    SearchSpace,
    Seed,
    TrialRecord,
    TuningStudy,
    baseline_seeds,
    far_over_budget,
    inspect_layers,
    study_name,
)

if TYPE_CHECKING:
    from tuner.recipe import Recipe

__all__ = [
    "EXIT_INFEASIBLE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "HistorySummary",
    "PlanSummary",
    "SessionSummary",
    "TrialEvent",
    "history",
    "plan",
    "rollback",
    "tune",
]

_log = logging.getLogger(__name__)

EXIT_OK = 0
"""The output policy file holds the study's best feasible policy (promoted now, or already)."""
EXIT_INFEASIBLE = 1
"""Nothing promoted: no trial fitted the budget, or the gate kept the current policy."""
EXIT_BAD_RECIPE = 2
"""The recipe is invalid (the CLI prints every problem)."""
EXIT_INTERRUPTED = 130
"""Stopped by Ctrl-C (or SIGTERM); the study resumes on the next run."""

MAX_UNMEASURED_IN_A_ROW = 25
"""Proposals in a row that are duplicates or skipped before the session decides the space is exhausted."""

SETUP_WAIT_S = 600.0
"""How long a worker joining a new study waits for the worker that created it to profile and seed it."""

PROFILE_REPEATS = 2
"""Timed profiling steps per mode: the planner's times only order the seeds; trials measure for real."""

PLANNER_FRONT_SEEDS = 3
"""How many points of the planner's predicted Pareto front (besides its pick at the budget) are seeded."""

Notify = Callable[[str], None]


# ---------------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class TrialEvent:
    """What the CLI prints for one trial as it finishes."""

    record: TrialRecord
    """The trial just told to Optuna (measured, skipped or duplicate)."""
    best: TrialRecord | None
    """The best feasible trial of the study so far (any worker's)."""
    measured: int
    """Trials measured in the study so far (what ``n_trials`` counts)."""
    n_trials: int
    budget_bytes: int
    layer_names: tuple[str, ...]


@dataclass
class SessionSummary:
    """What a tuning session did and decided; the CLI prints it, ``--format json`` dumps `to_dict`."""

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
    """Every finished trial of the study, all sessions and workers."""
    best: TrialRecord | None = None
    baselines: dict[str, TrialRecord] = field(default_factory=dict)
    """Baseline name (``none``, ``full``, ``selective``, ``every_2nd_full``) -> its trial."""
    gains: dict[str, float | None] = field(default_factory=dict)
    """Baseline name -> the best trial's throughput over the baseline's, minus 1 (``None``: not measured)."""
    reasons: list[str] = field(default_factory=list)
    """The gate's reasons, or why there was nothing to gate."""
    evidence: dict[str, Any] = field(default_factory=dict)
    policy_path: Path | None = None
    """The policy file written (on promotion) or holding the current good policy."""
    tracking_uri: str = ""
    experiment: str = ""
    session_run_id: str | None = None
    decision_run_id: str | None = None
    notes: list[str] = field(default_factory=list)
    """What the session decided along the way (planner unavailable, space exhausted ...)."""

    @property
    def mlflow_command(self) -> str:
        """The command that browses this session in MLflow."""
        return f"mlflow ui --backend-store-uri {self.tracking_uri}"

    @property
    def ranked(self) -> list[TrialRecord]:
        """Measured trials: feasible ones first, each group by throughput, highest first."""
        rows = [r for r in self.records if r.measured and r.throughput is not None]
        return sorted(rows, key=lambda r: (not r.feasible, -(r.throughput or 0.0), r.number))

    def to_dict(self) -> dict[str, Any]:
        """Plain types (JSON-ready)."""
        return {
            "recipe": self.recipe,
            "study": self.study,
            "storage": self.storage,
            "device": self.device,
            "budget_bytes": self.budget_bytes,
            "layer_names": list(self.layer_names),
            "search_space": self.search_space,
            "status": self.status,
            "exit_code": self.exit_code,
            "trials_this_session": self.trials_this_session,
            "best": None if self.best is None else self.best.to_dict(),
            "baselines": {k: v.to_dict() for k, v in self.baselines.items()},
            "gains": dict(self.gains),
            "reasons": list(self.reasons),
            "evidence": _plain(self.evidence),
            "policy_path": None if self.policy_path is None else str(self.policy_path),
            "tracking_uri": self.tracking_uri,
            "experiment": self.experiment,
            "mlflow_command": self.mlflow_command,
            "session_run_id": self.session_run_id,
            "decision_run_id": self.decision_run_id,
            "trials": [r.to_dict() for r in self.records],
            "notes": list(self.notes),
        }


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, Path):
        return str(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _plain(dataclasses.asdict(obj))
    if hasattr(obj, "to_dict"):
        return _plain(obj.to_dict())
    return repr(obj)


# ---------------------------------------------------------------------------------------------- interrupts


class _Interrupts:
    """Ctrl-C state shared by the signal handler and the session loop.

    The handler only raises `KeyboardInterrupt` where that is safe and wanted: while a trial's
    subprocess runs (`tuner.trial.run_trial` kills its process group and re-raises), while
    profiling, and in the gate. Between trials it only asks the loop to stop, so an Optuna tell or
    an MLflow write is never cut in half.
    """

    def __init__(self, notify: Notify) -> None:
        self.stop = threading.Event()
        self.presses = 0
        self.phase = "setup"  # setup | trial | between | gate
        self._notify = notify

    def handle(self, signum: int, frame: Any) -> None:
        self.presses += 1
        self.stop.set()
        kill = signum != signal.SIGINT or self.presses > 1 or self.phase in ("setup", "gate")
        if self.phase == "trial" and not kill:
            self._notify("interrupt: finishing the current trial, then stopping (Ctrl-C again to kill it)")
            return
        if kill and self.phase != "between":
            self._notify("interrupt: stopping now")
            raise KeyboardInterrupt
        self._notify("interrupt: stopping")

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Interrupts]:
        """Install the handler for SIGINT and SIGTERM (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


# ---------------------------------------------------------------------------------------------- planning

_PRECISION_DTYPES = {"bf16-true": "bfloat16", "16-true": "float16", "64-true": "float64"}


def profile_recipe(recipe: Recipe, micro_batch: int | None = None, *, repeats: int = 3) -> Any:
    """The per-layer cost profile (`tuner.profile.Profile`) of ``recipe``'s model on its device.

    On CPU it runs here. On an accelerator it runs in a fresh process, like a trial: a CUDA
    context created in the tuning process would hold device memory that every trial then lacks.

    Raises:
        RecomputeError: the profile could not be taken (the message says why).
    """
    if recipe.trainer.accelerator == "cpu":
        return _profile_here(recipe, micro_batch, repeats)
    import multiprocessing
    import tempfile

    from tuner.profile import Profile

    with tempfile.TemporaryDirectory(prefix="recompute-profile-") as tmp:
        out = Path(tmp) / "profile.json"
        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(
            target=_profile_child,
            args=(
                recipe.to_dict(),
                None if recipe.source is None else str(recipe.source),
                micro_batch,
                repeats,
                str(out),
            ),
        )
        proc.start()
        try:
            proc.join(recipe.trial.timeout_s * 2)
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join()
        if not out.exists():
            raise RecomputeError(f"profiling failed (exit code {proc.exitcode}) without a profile")
        text = out.read_text(encoding="utf-8")
        if text.startswith("error:"):
            raise RecomputeError(f"profiling failed: {text[len('error:') :].strip()}")
        return Profile.from_json(text)


def _profile_child(
    recipe_dict: dict[str, Any], source: str | None, micro_batch: int | None, repeats: int, out: str
) -> None:
    from tuner.recipe import from_dict

    try:
        text = _profile_here(from_dict(recipe_dict, source=source), micro_batch, repeats).to_json()
    except Exception as err:  # noqa: BLE001 - reported to the parent as text
        text = f"error: {type(err).__name__}: {err}"
    Path(out).write_text(text, encoding="utf-8")


def _profile_here(recipe: Recipe, micro_batch: int | None, repeats: int) -> Any:
    import torch

    from tuner.profile import profile_model
    from tuner.recipe import build_datamodule, build_model

    torch.manual_seed(recipe.search.seed)
    model = build_model(recipe)
    data = build_datamodule(recipe, micro_batch)
    data.prepare_data()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    device = "cpu"
    if recipe.trainer.accelerator in ("cuda", "auto") and torch.cuda.is_available():
        device = "cuda"
    dtype = _PRECISION_DTYPES.get(recipe.trainer.precision)
    model = model.to(device=device, dtype=getattr(torch, dtype) if dtype else None)
    # Time the profile under the trials' conditions: a recipe that pins trial threads
    # (trial.env OMP_NUM_THREADS) would otherwise be predicted at another speed than it runs.
    threads = recipe.trial.env.get("OMP_NUM_THREADS")
    previous = torch.get_num_threads()
    if threads is not None and str(threads).isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    try:
        return profile_model(model, batch, recipe.layers, modes=list(recipe.search.modes), repeats=repeats)
    finally:
        torch.set_num_threads(previous)


@dataclass
class _Plan:
    """The planner's view of the recipe, or why there is none."""

    planner: Any = None
    profile: Any = None
    seeds: list[Seed] = field(default_factory=list)
    note: str | None = None

    def predictor(self) -> Predictor | None:
        """``(policy, micro_batch) -> Prediction``, or ``None`` without a planner."""
        if self.planner is None:
            return None
        planner = self.planner

        def predict(policy: RecomputePolicy, micro_batch: int | None) -> Prediction | None:
            try:
                p = planner.predict(policy, micro_batch=micro_batch)
            except RecomputeError as err:
                _log.info("no prediction for %s: %s", policy.fingerprint(), err)
                return None
            return Prediction(peak_bytes=int(p.peak_bytes), step_time_s=float(p.step_seconds))

        return predict


def _planner_seeds(
    planner: Any, space: SearchSpace, budget_bytes: int, modes: Sequence[str]
) -> tuple[list[Seed], list[str]]:
    """The planner's pick at the budget (per micro-batch size), and a few points of its front under it."""
    from tuner.planner import BudgetError

    seeds: list[Seed] = []
    notes: list[str] = []
    sizes: list[int | None] = list(space.micro_batches) if space.micro_batches else [None]
    for mb in sizes:
        at = "" if mb is None or len(sizes) == 1 else f"@mb{mb}"
        try:
            pick = planner.solve(budget_bytes, modes=list(modes), micro_batch=mb)
        except BudgetError as err:
            notes.append(f"planner: nothing fits at micro-batch {mb if mb is not None else 'default'}: {err}")
            continue
        seeds.append(Seed(f"planner:budget{at}", dict(pick.modes), mb))
        # Fitting points of the front other than the pick, evenly over it: alternatives the
        # prediction error could reorder.
        front = [p for p in planner.pareto_front(list(modes), micro_batch=mb) if p.peak_bytes <= budget_bytes]
        front = [p for p in front if dict(p.modes) != dict(pick.modes)]
        if front:
            count = min(PLANNER_FRONT_SEEDS, len(front))
            idx = sorted({round(i * (len(front) - 1) / max(1, count - 1)) for i in range(count)})
            seeds += [Seed(f"planner:front{j + 1}{at}", dict(front[i].modes), mb) for j, i in enumerate(idx)]
    return seeds, notes


def _make_plan(recipe: Recipe, space: SearchSpace, budget_bytes: int, stored: dict[str, Any] | None = None) -> _Plan:
    """Profile the recipe's model (or reuse ``stored``, the study's profile) and build the planner.

    The planner only steers the search (seeds, skipping hopeless candidates); a session without
    it still measures every trial, so its failure is a note, not an error.
    """
    try:
        from tuner.planner import Planner
        from tuner.profile import Profile
    except ImportError as err:
        return _Plan(note=f"planner unavailable ({err}); seeding from baselines only, no candidate skipped")
    try:
        mb = space.micro_batches[0] if space.micro_batches else None
        profile = (
            Profile.from_dict(stored) if stored is not None else profile_recipe(recipe, mb, repeats=PROFILE_REPEATS)
        )
        planner = Planner(profile)
        seeds, notes = _planner_seeds(planner, space, budget_bytes, recipe.search.modes)
    except KeyboardInterrupt:
        raise
    except Exception as err:  # noqa: BLE001 - the search works without predictions; say why there are none
        _log.debug("planning failed", exc_info=True)
        return _Plan(note=f"planner failed ({type(err).__name__}: {err}); seeding from baselines only")
    if recipe.trainer.precision.endswith("-mixed"):
        notes.append(
            f"planner: profiled without autocast; {recipe.trainer.precision} trials may differ from predictions"
        )
    return _Plan(planner=planner, profile=profile, seeds=seeds, note="; ".join(notes) or None)


# ---------------------------------------------------------------------------------------------- tune


def tune(
    recipe: Recipe,
    *,
    n_trials: int | None = None,
    search_only: bool = False,
    use_planner: bool = True,
    on_trial: Callable[[TrialEvent], None] | None = None,
    on_note: Notify | None = None,
    handle_signals: bool = True,
) -> SessionSummary:
    """Run one tuning session of ``recipe`` and decide whether to promote its best policy.

    Args:
        recipe: a loaded recipe (`tuner.recipe.load`).
        n_trials: how many trials the *study* should have measured when this session stops
            (default: the recipe's ``search.n_trials``); a resumed study only runs the rest.
        search_only: search, then report the best without the gate or a promotion (workers
            sharing a study; the last run gates).
        use_planner: profile the model and plan when this session sets the study up (seeds
            from the planner, planner-predicted hopeless candidates skipped). Without it the
            study is seeded with the baselines only; a profile already in the study is still used.
        on_trial: called after every trial with what the CLI prints.
        on_note: called with one-line progress notes.
        handle_signals: install the Ctrl-C handling described in the module docstring.

    Returns:
        The summary; its ``exit_code`` is what ``recompute-tune`` exits with.

    Raises:
        RecomputeError: the recipe cannot be tuned as written (layers not found, study clash ...).
    """
    notify = on_note or (lambda _msg: None)
    interrupts = _Interrupts(notify)
    guard = interrupts.installed() if handle_signals else contextlib.nullcontext(interrupts)
    with guard:
        return _Session(recipe, n_trials, search_only, use_planner, on_trial, notify, interrupts).run()


class _Session:
    """The state of one `tune` call (kept off module level: several may run in one process)."""

    def __init__(
        self,
        recipe: Recipe,
        n_trials: int | None,
        search_only: bool,
        use_planner: bool,
        on_trial: Callable[[TrialEvent], None] | None,
        notify: Notify,
        interrupts: _Interrupts,
    ) -> None:
        if n_trials is not None and (not isinstance(n_trials, int) or n_trials < 1):
            raise RecomputeError(f"n_trials: must be a positive integer, got {n_trials!r}")
        self.recipe = recipe
        self.n_trials = n_trials if n_trials is not None else recipe.search.n_trials
        self.search_only = search_only
        self.use_planner = use_planner
        self.on_trial = on_trial
        self.notify = notify
        self.interrupts = interrupts
        self.notes: list[str] = []
        self.study: TuningStudy | None = None
        self.tracker: Any = None
        self.session_run_id: str | None = None
        self.in_flight: Proposal | None = None
        self.plan: _Plan | None = None
        self.predict: Predictor | None = None
        self.ran = 0

    def note(self, message: str) -> None:
        self.notes.append(message)
        self.notify(message)

    # -------------------------------------------------------------- the flow

    def run(self) -> SessionSummary:
        from tuner.trial import device_info

        recipe = self.recipe
        device, total = device_info(recipe)
        self.budget = recipe.budget.limit_bytes(total)
        layers = inspect_layers(recipe)
        self.space = SearchSpace.for_layers(layers, recipe.search.modes, recipe.search.micro_batch_sizes)
        self.device = device
        self.name = study_name(recipe, device)
        self.notify(f"recipe {recipe.name}: {len(layers)} layers on {device}; budget {recipe.budget.describe(total)}")
        self.notify(f"search space {self.space.describe()}")
        try:
            self.study = TuningStudy.open(
                name=self.name,
                storage=str(recipe.study.storage),
                space=self.space,
                budget_bytes=self.budget,
                seed=recipe.search.seed,
                attrs={"recipe": recipe.name, "recipe_fingerprint": recipe.fingerprint(), "device": device},
            )
            self.plan = self._setup_study()
            self.predict = self.plan.predictor()
            self.interrupts.phase = "between"
            self.tracker = _open_tracker(recipe)
            self.session_run_id = self.tracker.start_session(recipe, study_name=self.name, resume=True)
            stop_reason = self._search()
            if self.interrupts.stop.is_set():
                return self._finish_interrupted("stopped after the current trial")
            if stop_reason:
                self.note(stop_reason)
            return self._decide()
        except KeyboardInterrupt:
            return self._finish_interrupted("killed")
        except BaseException as err:
            self._finish_failed(err)
            raise

    def _finish_failed(self, err: BaseException) -> None:
        """Leave nothing running after an unexpected error: the trial told FAIL, the session run FAILED."""
        why = f"session failed: {type(err).__name__}: {err}"
        with contextlib.suppress(Exception):
            if self.in_flight is not None and self.study is not None:
                self.study.tell_interrupted(self.in_flight, why)
                self.in_flight = None
        with contextlib.suppress(Exception):
            if self.study is not None and self.plan is None:
                self.study.abandon_setup()
        if self.tracker is not None:
            with contextlib.suppress(Exception):
                self.tracker.close("FAILED")

    def _setup_study(self) -> _Plan:
        """Profile, plan and seed the study once; reuse the stored profile when resuming or joining.

        The profile is kept in the study so a resumed session and every worker sharing the study
        predict with the same figures (and skip the same candidates) without profiling again.
        """
        study = self.study
        assert study is not None
        takes_over = study.created
        if not takes_over:
            if not study.study.user_attrs.get("seeded"):
                self.notify(f"study {self.name} is being set up by another worker; waiting ...")
            takes_over = not study.wait_seeded(SETUP_WAIT_S)
        if not takes_over:
            stored = study.study.user_attrs.get("profile")
            plan = (
                _make_plan(self.recipe, self.space, self.budget, stored=stored)
                if stored
                else _Plan(
                    note=study.study.user_attrs.get("planner_note") or "the study holds no profile; no predictions"
                )
            )
            plan.seeds = []  # the study was seeded by the session that set it up
            if plan.note:
                self.note(plan.note)
            self.notify(f"study {self.name} resumed: {study.measured_count()} trials measured so far")
            return plan
        try:
            if self.use_planner:
                self.notify("profiling the model and planning ...")
                plan = _make_plan(self.recipe, self.space, self.budget)
            else:
                plan = _Plan(note="planner not used (asked not to plan); seeding from baselines only")
            if plan.profile is not None:
                study.study.set_user_attr("profile", plan.profile.to_dict())
            if plan.note:
                study.study.set_user_attr("planner_note", plan.note)
                self.note(plan.note)
            enqueued = study.seed([*baseline_seeds(self.space), *plan.seeds])
        except BaseException:
            study.abandon_setup()
            raise
        self.notify(f"study {self.name} created; seeded {', '.join(enqueued) or 'nothing'}")
        return plan

    def _search(self) -> str | None:
        """Ask, run and tell trials until the study has ``n_trials`` measured; why it stopped early."""
        assert self.study is not None
        started = time.monotonic()
        timeout = self.recipe.search.timeout_s
        unmeasured = 0
        while True:
            self.interrupts.phase = "between"
            if self.interrupts.stop.is_set():
                return None
            if self.study.measured_count() >= self.n_trials:
                return None
            if timeout is not None and time.monotonic() - started >= timeout:
                return f"search.timeout_s ({timeout:g} s) reached"
            if unmeasured >= MAX_UNMEASURED_IN_A_ROW:
                return f"search space exhausted: {unmeasured} proposals in a row were duplicates or skipped"
            measured = self._one_trial()
            unmeasured = 0 if measured else unmeasured + 1

    def _one_trial(self) -> bool:
        """One proposal, run or not; whether it was measured."""
        from tuner.trial import TrialResult, run_trial

        study = self.study
        if study is None:
            raise RuntimeError("_one_trial called before the study was opened")
        proposal = study.ask()
        self.in_flight = proposal
        if proposal.duplicate_of is not None:
            reason = f"duplicate of trial {proposal.duplicate_of.number} (same policy and micro-batch)"
            run_id = self._log(proposal, TrialResult.skipped(reason, device=self.device), reason)
            frozen = study.tell_duplicate(proposal, run_id=run_id)
            self._event(frozen.number)
            return False
        if self.predict is not None:
            proposal.prediction = self.predict(proposal.policy, proposal.micro_batch)
        skip = far_over_budget(proposal.prediction, self.budget)
        if skip is not None:
            run_id = self._log(proposal, TrialResult.skipped(skip, device=self.device), skip)
            frozen = study.tell_skipped(proposal, skip, run_id=run_id)
            self._event(frozen.number)
            return False
        self.interrupts.phase = "trial"
        try:
            result = run_trial(self.recipe, proposal.policy, micro_batch=proposal.micro_batch, budget_bytes=self.budget)
        finally:
            self.interrupts.phase = "between"
        run_id = self._log(proposal, result, None)
        frozen = study.tell_result(proposal, result, run_id=run_id)
        self.in_flight = None
        self.ran += 1
        self._event(frozen.number)
        return True

    def _log(self, proposal: Proposal, result: Any, reason: str | None) -> str | None:
        pred = proposal.prediction.to_dict() if proposal.prediction is not None else None
        return self.tracker.log_trial(
            proposal.number,
            proposal.policy,
            list(self.space.layer_names),
            proposal.micro_batch,
            result,
            pred,
            reason=reason,
        )

    def _event(self, number: int) -> None:
        self.in_flight = None
        if self.on_trial is None or self.study is None:
            return
        records = self.study.records()
        record = next(r for r in records if r.number == number)
        feasible = [r for r in records if r.feasible and r.throughput is not None]
        best = max(feasible, key=lambda r: (r.throughput, -r.number)) if feasible else None
        self.on_trial(
            TrialEvent(
                record=record,
                best=best,
                measured=sum(1 for r in records if r.measured),
                n_trials=self.n_trials,
                budget_bytes=self.budget,
                layer_names=self.space.layer_names,
            )
        )

    # -------------------------------------------------------------- endings

    def _summary(self, status: str, exit_code: int) -> SessionSummary:
        records = self.study.records() if self.study is not None else []
        best = self.study.best() if self.study is not None else None
        baselines = _baselines(records)
        gains: dict[str, float | None] = {}
        for name, rec in baselines.items():
            ok = best is not None and best.throughput and rec.throughput and rec.measured
            gains[name] = (best.throughput / rec.throughput - 1.0) if ok else None  # type: ignore[operator,union-attr]
        return SessionSummary(
            recipe=self.recipe.name,
            study=self.name,
            storage=str(self.recipe.study.storage),
            device=self.device,
            budget_bytes=self.budget,
            layer_names=self.space.layer_names,
            search_space=self.space.describe(),
            status=status,
            exit_code=exit_code,
            trials_this_session=self.ran,
            records=records,
            best=best,
            baselines=baselines,
            gains=gains,
            policy_path=None,
            tracking_uri=self.recipe.tracking.uri,
            experiment=str(self.recipe.tracking.experiment),
            session_run_id=self.session_run_id,
            notes=self.notes,
        )

    def _finish_tracking(self, status: str, summary: SessionSummary) -> None:
        if self.tracker is None or self.session_run_id is None:
            return
        # What the session decided without a trial (space, planner trouble, why it stopped) is
        # part of the record too: MLflow alone must explain the session.
        notes = [
            f"study {self.name} ({summary.storage})",
            f"search space {summary.search_space}",
            f"status {summary.status}",
            *summary.notes,
        ]
        self.tracker.client.set_tag(self.session_run_id, "recompute.session_notes", "\n".join(notes)[:4900])
        self.tracker.finish_session(
            status=status,
            best=None if summary.best is None else summary.best.to_dict(),
            trials_table=[r.to_dict() for r in summary.records],
            baselines={k: v.to_dict() for k, v in summary.baselines.items()},
            budget_bytes=self.budget,
        )

    def _finish_interrupted(self, how: str) -> SessionSummary:
        # Handlers stay installed: a further Ctrl-C during this bookkeeping only sets the flag.
        self.interrupts.phase = "between"
        if self.in_flight is not None and self.study is not None:
            self.study.tell_interrupted(self.in_flight, f"interrupted by the user ({how})")
            self.in_flight = None
        self.note(f"interrupted ({how}); run the same command again to resume the study")
        summary = self._summary("interrupted", EXIT_INTERRUPTED)
        self._finish_tracking("KILLED", summary)
        return summary

    def _decide(self) -> SessionSummary:
        """Gate the best feasible trial against the current good policy; promote or keep."""
        best = self.study.best() if self.study is not None else None
        if best is None:
            summary = self._summary("infeasible", EXIT_INFEASIBLE)
            summary.reasons.append(
                f"no measured trial fits the budget limit of {self.budget} bytes"
                if summary.ranked
                else "no trial was measured"
            )
            self._finish_tracking("FINISHED", summary)
            return summary
        if self.search_only:
            summary = self._summary("searched", EXIT_OK)
            summary.reasons.append("search only: best feasible trial reported, not gated or promoted")
            self._finish_tracking("FINISHED", summary)
            return summary
        from tuner import gate
        from tuner.trial import check_numerics, run_trial

        self.notify(f"gate: confirming trial {best.number} ({best.short}) ...")
        candidate = gate.Candidate(
            policy=best.policy,
            micro_batch=best.micro_batch,
            source_run_id=best.run_id,
            layer_names=self.space.layer_names,
        )
        decision = gate.decide(
            self.tracker,
            candidate,
            recipe=self.recipe,
            budget_bytes=self.budget,
            output_path=self.recipe.output,
            run_trial=self._killable(run_trial),
            check_numerics=self._killable(check_numerics),
        )
        if decision.unchanged:
            status, code = "current", EXIT_OK
        elif decision.promoted:
            status, code = "promoted", EXIT_OK
        else:
            status, code = "rejected", EXIT_INFEASIBLE
        summary = self._summary(status, code)
        summary.policy_path = self.recipe.output if (decision.promoted or self.tracker.current_good()) else None
        summary.reasons.extend(decision.reasons)
        summary.evidence = dict(decision.evidence)
        summary.decision_run_id = decision.decision_run_id
        self._finish_tracking("FINISHED", summary)
        return summary

    def _killable(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with the first Ctrl-C stopping it (the gate's measurements; not its records)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            self.interrupts.phase = "gate"
            try:
                return fn(*args, **kwargs)
            finally:
                self.interrupts.phase = "between"

        return call


def _open_tracker(recipe: Recipe, attempts: int = 5) -> Any:
    """The recipe's `tuner.tracking.Tracker`, opened under the SQLite setup lock, retried on failure.

    Two workers starting at once against a new SQLite tracking database would both run MLflow's
    schema migration and fail on each other's half-made tables; the lock serialises that. The
    retry covers stores the lock cannot (no ``fcntl``; a server still starting).
    """
    from alembic.util.exc import CommandError
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    from tuner.search import sqlite_setup_lock
    from tuner.tracking import Tracker

    for attempt in range(1, attempts + 1):
        try:
            with sqlite_setup_lock(recipe.tracking.uri):
                return Tracker(recipe.tracking.uri, str(recipe.tracking.experiment))
        except (CommandError, MlflowException, SQLAlchemyError) as err:
            if attempt == attempts:
                raise
            _log.info("opening the MLflow store failed (%s); retrying", err)
            time.sleep(0.5 * attempt)
    raise AssertionError("unreachable")  # the loop returns or raises


def _baselines(records: Sequence[TrialRecord]) -> dict[str, TrialRecord]:
    """Each baseline's trial: the measured one (a re-queued seed may have an interrupted record too),
    or, for a baseline that was a duplicate, the trial it duplicated."""
    by_number = {r.number: r for r in records}
    out: dict[str, TrialRecord] = {}
    for r in records:
        if not (r.seed or "").startswith("baseline:"):
            continue
        name = r.seed.split(":", 1)[1]  # type: ignore[union-attr]
        if r.outcome == "duplicate" and r.duplicate_of in by_number:
            r = by_number[r.duplicate_of]
        if r.outcome == "interrupted":
            out.setdefault(name, r)
            continue
        if name not in out or out[name].outcome == "interrupted":
            out[name] = r
    return out


# ---------------------------------------------------------------------------------------------- plan, rollback, history


@dataclass
class PlanSummary:
    """What ``recompute-tune plan`` shows: the predicted front and the policy chosen for a budget."""

    recipe: str
    device: str
    budget_bytes: int
    layer_names: tuple[str, ...]
    front: list[Any]
    """`tuner.planner.Plan` objects, by increasing predicted peak."""
    chosen: Any = None
    """The fastest predicted plan within the budget (``None`` when none fits)."""
    reason: str | None = None
    """Why nothing was chosen."""
    profile: Any = None
    written: Path | None = None
    """Where the chosen policy was written (``--write``)."""
    exit_code: int = EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        """Plain types (JSON-ready)."""

        def row(p: Any) -> dict[str, Any]:
            return {
                "policy": p.policy.to_dict(),
                "short": p.short(),
                "peak_bytes": p.peak_bytes,
                "step_time_s": p.step_seconds,
                "micro_batch": p.prediction.micro_batch,
            }

        return {
            "recipe": self.recipe,
            "device": self.device,
            "budget_bytes": self.budget_bytes,
            "layer_names": list(self.layer_names),
            "front": [row(p) for p in self.front],
            "chosen": None if self.chosen is None else row(self.chosen),
            "reason": self.reason,
            "written": None if self.written is None else str(self.written),
            "exit_code": self.exit_code,
        }


def plan(
    recipe: Recipe, *, budget: str | int | None = None, write: str | Path | None = None, meta: str | None = None
) -> PlanSummary:
    """Profile the recipe's model and show the planner's front and its choice at ``budget``.

    Args:
        recipe: a loaded recipe.
        budget: bytes or a size (``"20GiB"``); default: the recipe's budget limit (after its margin).
        write: write the chosen policy here (YAML, or JSON for ``.json``), atomically.
        meta: plan without the hardware and without allocating: profile the model on the meta
            device and estimate time for this accelerator (a key of `tuner.profile.HARDWARE`), so a
            7B model can be planned for an 80 GiB GPU on a laptop.

    Raises:
        RecomputeError: the budget is not a size, the hardware is unknown, or the model cannot be profiled.
    """
    from tuner.planner import BudgetError, Planner, parse_bytes
    from tuner.trial import device_info

    mb = recipe.search.micro_batch_sizes[0] if recipe.search.micro_batch_sizes else None
    if meta is not None:
        from tuner.profile import HARDWARE

        if meta not in HARDWARE:
            raise RecomputeError(f"--meta: unknown hardware {meta!r}; valid: {', '.join(HARDWARE)}")
        device, total = f"{HARDWARE[meta].name} (estimated on the meta device)", HARDWARE[meta].memory_bytes
    else:
        device, total = device_info(recipe)
    limit = recipe.budget.limit_bytes(total) if budget is None else parse_bytes(budget)
    if limit <= 0:
        raise RecomputeError(f"--budget: must be a positive size such as 20GiB, got {budget!r}")
    profile = _profile_meta(recipe, mb, meta) if meta is not None else profile_recipe(recipe, mb)
    planner = Planner(profile)
    modes = list(recipe.search.modes)
    summary = PlanSummary(
        recipe=recipe.name,
        device=device,
        budget_bytes=limit,
        layer_names=tuple(profile.layer_names),
        front=planner.pareto_front(modes, micro_batch=mb),
        profile=profile,
    )
    try:
        summary.chosen = planner.solve(limit, modes=modes, micro_batch=mb)
    except BudgetError as err:
        summary.reason = str(err)
        summary.exit_code = EXIT_INFEASIBLE
        return summary
    if write is not None:
        summary.written = summary.chosen.policy.save(write)
    return summary


def _profile_meta(recipe: Recipe, micro_batch: int | None, hardware: str) -> Any:
    import torch

    from tuner.profile import profile_meta
    from tuner.recipe import build_datamodule, build_model

    data = build_datamodule(recipe, micro_batch)
    data.prepare_data()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    dtype = _PRECISION_DTYPES.get(recipe.trainer.precision)

    def factory() -> Any:
        # Called under torch.device("meta") by profile_meta: parameters cost nothing.
        model = build_model(recipe)
        return model.to(dtype=getattr(torch, dtype)) if dtype else model

    return profile_meta(factory, batch, recipe.layers, modes=list(recipe.search.modes), hardware=hardware)


@dataclass
class HistorySummary:
    """What ``recompute-tune history`` shows: every decision, and the good policy now."""

    experiment: str
    tracking_uri: str
    decisions: list[Any]
    """`tuner.tracking.Decision`, oldest first."""
    current: Any = None
    """`tuner.tracking.GoodPolicy`, or ``None`` before the first promotion."""

    def to_dict(self) -> dict[str, Any]:
        """Plain types (JSON-ready)."""
        return {
            "experiment": self.experiment,
            "tracking_uri": self.tracking_uri,
            "decisions": [_plain(d) for d in self.decisions],
            "current": None if self.current is None else _plain(self.current),
        }


def history(recipe: Recipe) -> HistorySummary:
    """Every promotion, rejection and rollback recorded for ``recipe``'s experiment, from MLflow alone."""
    from tuner.tracking import Tracker

    tracker = Tracker(recipe.tracking.uri, str(recipe.tracking.experiment))
    return HistorySummary(
        experiment=str(recipe.tracking.experiment),
        tracking_uri=recipe.tracking.uri,
        decisions=tracker.history(),
        current=tracker.current_good(),
    )


def rollback(recipe: Recipe) -> Any:
    """Restore the previous good policy (MLflow record and ``recipe.output``); the restored `GoodPolicy`.

    Raises:
        RecomputeError: there is nothing to roll back to.
    """
    from tuner.tracking import Tracker

    return Tracker(recipe.tracking.uri, str(recipe.tracking.experiment)).rollback(output_path=recipe.output)
