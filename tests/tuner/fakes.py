"""Stand-ins for the tuner's trial runner and numerics check, and the tiny recipes they price.

`ExactTrials` prices a session's trials per mode (exact peaks and speeds, so a session's bookkeeping
can be checked exactly); `FixedTrials` gives the gate fixed figures per policy. Optuna and MLflow
stay real in the tests that use them.
"""

from __future__ import annotations

from typing import Any, cast

from mlflow import MlflowClient

from lightning_recompute.policy import RecomputePolicy
from lightning_recompute.race import RaceEntrant, RaceResult
from tuner._search import TuningStudy
from tuner._trials import NumericsResult, Outcome, TrialResult
from tuner.recipe import from_dict

GATE_LAYERS = ("blocks.0", "blocks.1")
"""The two layers of the gate tests' model."""

MIB = 1 << 20
KEPT = {"none": 4 * MIB, "selective": 2 * MIB, "full": 1 * MIB}
COST = {"none": 0.0, "selective": 30.0, "full": 100.0}
BASE = 2 * MIB
SESSION_LAYERS = ("blocks.0", "blocks.1", "blocks.2")
"""The three layers of `make_recipe`'s model, which `ExactTrials` prices."""


def fake_peak(policy: RecomputePolicy | None) -> int:
    assert policy is not None, "every measured trial records its policy"
    return BASE + sum(KEPT[policy.mode_for(n).value] for n in SESSION_LAYERS)


def fake_throughput(policy: RecomputePolicy | None) -> float:
    assert policy is not None, "every measured trial records its policy"
    return 1000.0 - sum(COST[policy.mode_for(n).value] for n in SESSION_LAYERS)


TRIAL_WALL_S = 2.0
"""What every `ExactTrials` trial says it took (the race's budget is a share of the trials' sum)."""


class ExactTrials:
    """`run_trial` / `check_numerics` stand-ins for a session: exact figures per mode, and a log of calls."""

    def __init__(self, on_call=None, batches=None):
        self.calls: list[str] = []
        self.races: list[list[str]] = []
        self.plans: list[Any] = []
        """The `RacePlan` each race was given (``None``: the recipe's)."""
        self.on_call = on_call
        self.batches = batches
        """The data scan every trial reports (`tuner._trials.batches.BatchScan.to_dict`), or ``None``."""

    def run_trial(
        self,
        recipe,
        policy,
        *,
        micro_batch=None,
        warmup_steps=None,
        measure_steps=None,
        timeout_s=None,
        budget_bytes=None,
    ):
        self.calls.append(policy.short(SESSION_LAYERS))
        if self.on_call is not None:
            self.on_call(len(self.calls), policy)
        steps = measure_steps or recipe.trial.measure_steps
        peak, thr = fake_peak(policy), fake_throughput(policy)
        over = budget_bytes is not None and peak > budget_bytes
        return TrialResult(
            outcome="over_budget" if over else "ok",
            peak_bytes=peak,
            step_time_s=1.0 / thr,
            throughput=thr,
            throughput_unit="tokens/s",
            step_times_s=(1.0 / thr,) * steps,
            wall_s=TRIAL_WALL_S,
            device="cpu",
            batches=self.batches,
        )

    def check_numerics(self, recipe, policy, *, micro_batch=None, timeout_s=None):
        return NumericsResult(equal=True, max_abs_diff=0.0, detail="fake: bitwise equal")

    def run_race(
        self,
        recipe,
        entrants,
        *,
        layer_names,
        references=(),
        micro_batch=None,
        budget_bytes=None,
        plan=None,
    ):
        """The race the real engine would run on exact figures: same rule, rounds without noise."""
        self.races.append([p.short(SESSION_LAYERS) for p, _ in entrants])
        self.plans.append(plan)
        times = {p.fingerprint(): 1.0 / fake_throughput(p) for p, _ in entrants}
        peaks = {p.fingerprint(): fake_peak(p) for p, _ in entrants}
        return exact_race(entrants, times, peaks, references)


def make_recipe(tmp_path, tracking_uri, *, n_trials=5, budget="12MiB", race=None):
    data = {
        "model": {"init_args": {"n_layer": 3, "n_embd": 32, "seq_len": 32, "n_head": 2}},
        "budget": {"value": budget, "margin": 0.05},
        "search": {"n_trials": n_trials, "seed": 0},
        "trial": {"warmup_steps": 1, "measure_steps": 2},
        "tracking": {"uri": tracking_uri, "experiment": f"exp-{tmp_path.name}"},
        "study": {"storage": "optuna.log"},
        "race": race or {},
    }
    return from_dict(data, source=tmp_path / "recipe.yaml")


def study_of(recipe, summary) -> TuningStudy:
    from tuner._search import SearchSpace, inspect_layers

    space = SearchSpace.for_layers(inspect_layers(recipe), recipe.search.modes)
    return TuningStudy.open(
        name=summary.study, storage=str(recipe.study.storage), space=space, budget_bytes=summary.budget_bytes
    )


def runs(recipe, kind=None):
    client = MlflowClient(recipe.tracking.uri)
    exp = client.get_experiment_by_name(recipe.tracking.experiment)
    assert exp is not None
    found = client.search_runs([exp.experiment_id], max_results=1000)
    return [r for r in found if kind is None or r.data.tags.get("recompute.kind") == kind]


class FixedTrials:
    """`run_trial` stand-in for the gate: each policy has a fixed peak and throughput; every call is recorded."""

    def __init__(
        self,
        speeds: dict[RecomputePolicy, float],
        peaks: dict[RecomputePolicy, int] | None = None,
        outcome: dict[RecomputePolicy, str] | None = None,
        short_by: int = 0,
    ) -> None:
        self.speeds, self.peaks, self.outcome, self.short_by = speeds, peaks or {}, outcome or {}, short_by
        self.calls: list[dict[str, Any]] = []
        self.races: list[list[RecomputePolicy]] = []

    def __call__(self, recipe: Any, policy: RecomputePolicy, **kw: Any) -> TrialResult:
        self.calls.append({"policy": policy, **kw})
        outcome = self.outcome.get(policy, "ok")
        if outcome not in ("ok", "over_budget"):
            return TrialResult(outcome=outcome, error=f"injected {outcome}")  # type: ignore[arg-type]
        peak = self.peaks.get(policy, 50 * 2**20)
        if kw.get("budget_bytes") is not None and peak > kw["budget_bytes"]:
            outcome = "over_budget"
        thr = self.speeds[policy]
        n = kw["measure_steps"] - self.short_by
        return TrialResult(
            outcome=cast(Outcome, outcome),
            peak_bytes=peak,
            step_time_s=1 / thr,
            throughput=thr,
            tokens_per_s=thr,
            throughput_unit="tokens/s",
            step_times_s=(1 / thr,) * n,
            wall_s=1.0,
            device="cpu",
        )

    def run_race(
        self,
        recipe: Any,
        entrants: Any,
        *,
        layer_names: Any,
        references: Any = (),
        micro_batch: Any = None,
        budget_bytes: int | None = None,
        plan: Any = None,
    ) -> RaceResult:
        """The race on the fixed figures (exact rounds, the real rule); a policy whose outcome is a
        failure fails the whole race, as a step raising in the engine's one fit does."""
        self.races.append([p for p, _ in entrants])
        for p, _ in entrants:
            if self.outcome.get(p, "ok") not in ("ok", "over_budget"):
                return RaceResult(outcome="failed", reason=f"the race ended error: injected {self.outcome[p]}")
        return exact_race(
            entrants,
            {p.fingerprint(): 1.0 / self.speeds[p] for p, _ in entrants},
            {p.fingerprint(): self.peaks.get(p, 50 * 2**20) for p, _ in entrants},
            references,
            layer_names=GATE_LAYERS,
            budget_bytes=budget_bytes,
        )

    def who(self, names: dict[RecomputePolicy, str]) -> list[str]:
        """The calls' policies, by the names given."""
        return [names[c["policy"]] for c in self.calls]


def numerics(equal: bool = True) -> Any:
    calls: list[RecomputePolicy] = []

    def check(recipe: Any, policy: RecomputePolicy, **kw: Any) -> NumericsResult:
        calls.append(policy)
        if equal:
            return NumericsResult(True, 0.0, "loss and 12 gradients bitwise equal")
        return NumericsResult(False, 3e-3, "grad of blocks.1.mlp.weight differs")

    check.calls = calls  # type: ignore[attr-defined]
    return check


def exact_race(
    entrants, times, peaks, references=(), *, rounds=6, layer_names=SESSION_LAYERS, budget_bytes=None
) -> RaceResult:
    """A `RaceResult` of ``entrants`` (``(policy, labels)``) whose every round measures ``times``
    (fingerprint -> seconds) exactly, decided by the real rule (`lightning_recompute.race.rule.verdict`); an entrant
    peaking over ``budget_bytes`` is out, as in the engine."""
    from lightning_recompute.race.rule import verdict
    from lightning_recompute.race.stats import paired_ratio

    out = {k for k, peak in peaks.items() if budget_bytes is not None and peak is not None and peak > budget_bytes}
    keys = [p.fingerprint() for p, _ in entrants if p.fingerprint() not in out]
    shorts = {p.fingerprint(): p.short(layer_names) for p, _ in entrants}
    select = [dict(times) for _ in range(rounds)]
    standing, tied, winner = verdict(select, keys, peaks, shorts, confidence=0.95)
    estimated = [winner]
    refs = [p.fingerprint() for p in references if p.fingerprint() in keys and p.fingerprint() != winner]
    vs = {r: paired_ratio([times[winner]] * rounds, [times[r]] * rounds) for r in refs} if winner else {}
    return RaceResult(
        outcome="ok",
        entrants={
            p.fingerprint(): RaceEntrant(
                key=p.fingerprint(),
                short=shorts[p.fingerprint()],
                labels=tuple(labels),
                peak_bytes=peaks.get(p.fingerprint()),
                out=f"peaked at {peaks[p.fingerprint()]} bytes in the race, over the limit {budget_bytes}"
                if p.fingerprint() in out
                else None,
                select_s=(times[p.fingerprint()],) * len(select) if p.fingerprint() not in out else (None,),
                estimate_s=(times[p.fingerprint()],) * rounds if p.fingerprint() in (*estimated, *refs) else (),
                policy=p.to_dict(),
            )
            for p, labels in entrants
        },
        winner=winner,
        leader=None if standing is None else standing.leader,
        tied=tuple(tied),
        behind={} if standing is None else dict(standing.behind),
        vs=vs,
        stop="fake: exact figures",
        select_rounds=len(select),
        estimate_rounds=rounds if refs else 0,
        tokens_per_step=1,
    )
