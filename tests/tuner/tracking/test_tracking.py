"""tuner._tracking + tuner._plots against a real MLflow sqlite store, read back through MlflowClient."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from lightning_recompute.errors import PolicyError
from lightning_recompute.policy import RecomputePolicy
from tuner import recipe as recipe_mod
from tuner._plots import pareto_front, pareto_plot
from tuner._search import TrialRecord
from tuner._tracking import Tracker, TrackingError, artifact_location_for
from tuner._trials import TrialResult

LAYERS = ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def uri(tmp_path: Path, empty_db: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    shutil.copy(empty_db, tmp_path / "mlflow.db")
    # Run from an empty folder, to prove nothing is written to the working directory.
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def recipe(tmp_path: Path, uri: str) -> recipe_mod.Recipe:
    return recipe_mod.from_dict(
        {
            "name": "tiny",
            "budget": "64MiB",
            "model": {"init_args": {"n_layer": 4, "n_embd": 32, "n_head": 2, "seq_len": 16, "vocab_size": 64}},
            "trial": {"warmup_steps": 1, "measure_steps": 3},
            "tracking": {"uri": uri, "experiment": "tiny-exp"},
            "output": str(tmp_path / "policy.yaml"),
        }
    )


def ok(peak: int, thr: float, steps: int = 3) -> TrialResult:
    return TrialResult(
        outcome="ok",
        peak_bytes=peak,
        step_time_s=1.0 / thr,
        throughput=thr,
        tokens_per_s=thr,
        throughput_unit="tokens/s",
        step_times_s=tuple([1.0 / thr] * steps),
        wall_s=2.5,
        device="cpu",
    )


def runs_of(client: MlflowClient, exp_id: str, kind: str) -> list:
    return client.search_runs([exp_id], filter_string=f"tags.`recompute.kind` = '{kind}'")


def trial_numbers(uri: str, session_run_id: str) -> list[int]:
    """The numbers of the trial runs nested in ``session_run_id``, in order."""
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(session_run_id)
    runs = client.search_runs(
        [run.info.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{session_run_id}' and tags.`recompute.kind` = 'trial'",
    )
    return sorted(int(r.data.params["trial_number"]) for r in runs)


def record(
    number: int, policy: RecomputePolicy, micro_batch: int | None, result: TrialResult, **kw: Any
) -> TrialRecord:
    """The study's record of a trial that ran ``result`` (what the session's trials table is made of)."""
    return TrialRecord(
        number=number,
        state="COMPLETE" if result.measured else "FAIL",
        outcome=result.outcome,
        policy=policy,
        fingerprint=policy.fingerprint(),
        short=policy.short(LAYERS),
        micro_batch=micro_batch,
        label=None,
        throughput=result.throughput,
        throughput_unit=result.throughput_unit,
        peak_bytes=result.peak_bytes,
        step_time_s=result.step_time_s,
        reason=result.error,
        **kw,
    )


def test_session_trials_and_summary_are_laid_out_for_mlflow_ui(
    uri: str, recipe: recipe_mod.Recipe, tmp_path: Path
) -> None:
    full = RecomputePolicy.uniform("full")
    mixed = RecomputePolicy.first_n(LAYERS, 2, "selective")
    with Tracker(uri, "tiny-exp") as tracker:
        session = tracker.sessions.start_session(recipe, study_name="tiny-cpu")
        t0 = tracker.sessions.log_trial(
            0, full, LAYERS, None, ok(10 * 2**20, 900.0), prediction={"peak_bytes": 11 * 2**20, "step_time_s": 0.002}
        )
        t1 = tracker.sessions.log_trial(
            1,
            mixed,
            LAYERS,
            8,
            TrialResult(outcome="over_budget", peak_bytes=90 * 2**20, throughput=1500.0, throughput_unit="tokens/s"),
        )
        oom = TrialResult(outcome="oom", error="CUDA out of memory", stderr_tail="Traceback ...\nOOM")
        t2 = tracker.sessions.log_trial(2, RecomputePolicy.uniform("none"), LAYERS, 8, oom)
        rows = [
            record(0, full, None, ok(10 * 2**20, 900.0), run_id=t0, predicted_peak_bytes=11 * 2**20, feasible=True),
            record(
                1,
                mixed,
                8,
                TrialResult(
                    outcome="over_budget", peak_bytes=90 * 2**20, throughput=1500.0, throughput_unit="tokens/s"
                ),
                run_id=t1,
            ),
            record(2, RecomputePolicy.uniform("none"), 8, oom, run_id=t2),
        ]
        tracker.sessions.finish_session(
            status="FINISHED",
            best={"policy": full, "run_id": t0, "number": 0, "throughput": 900.0, "peak_bytes": 10 * 2**20},
            trials_table=[r.to_dict() for r in rows],
            baselines={"full": {"peak_bytes": 10 * 2**20, "throughput": 900.0}, "none": {"outcome": "oom"}},
            budget_bytes=60 * 2**20,
        )

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("tiny-exp")
    assert exp is not None and exp.artifact_location == str(tmp_path / "mlartifacts" / "tiny-exp")
    assert list((tmp_path / "cwd").iterdir()) == []  # no ./mlruns, no ./mlartifacts

    parent = client.get_run(session)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["recompute.kind"] == "session"
    assert parent.data.tags["recompute.study"] == "tiny-cpu"
    assert parent.data.tags["recompute.best_run_id"] == t0
    assert parent.data.tags["recompute.recipe_fingerprint"] == recipe.fingerprint()
    assert "Tuning session finished" in parent.data.tags["mlflow.note.content"]
    assert parent.data.params["recipe.trial.measure_steps"] == "3"
    assert parent.data.params["recipe.model.init_args.n_layer"] == "4"
    assert parent.data.params["study_name"] == "tiny-cpu"
    assert parent.data.metrics["best_throughput"] == 900.0
    assert parent.data.metrics["budget_limit_bytes"] == 60 * 2**20
    assert parent.data.metrics["trials_total"] == 3 and parent.data.metrics["trials_ok"] == 1
    artifacts = {f.path for f in client.list_artifacts(session)}
    assert artifacts == {
        "recipe.yaml",
        "best_policy.yaml",
        "best.json",
        "trials.json",
        "trials.csv",
        "baselines.json",
        "pareto.png",
    }
    dl = tmp_path / "dl"
    png = Path(client.download_artifacts(session, "pareto.png", str(dl)))
    assert png.read_bytes()[:8] == PNG_MAGIC
    best = RecomputePolicy.load(client.download_artifacts(session, "best_policy.yaml", str(dl)))
    assert best == full
    table = json.loads(Path(client.download_artifacts(session, "trials.json", str(dl))).read_text())
    assert table == [r.to_dict() for r in rows]  # the study's records, as they are
    assert [(r["number"], r["outcome"], r["run_id"]) for r in table] == [
        (0, "ok", t0),
        (1, "over_budget", t1),
        (2, "oom", t2),
    ]
    assert table[0]["predicted_peak_bytes"] == 11 * 2**20
    csv_rows = list(
        csv.DictReader(io.StringIO(Path(client.download_artifacts(session, "trials.csv", str(dl))).read_text()))
    )
    assert [r["policy_short"] for r in csv_rows] == ["FFFF", "ss..", "...."]
    assert RecomputePolicy.from_dict(json.loads(csv_rows[1]["policy"])) == mixed
    recipe_back = recipe_mod.from_dict(
        __import__("yaml").safe_load(Path(client.download_artifacts(session, "recipe.yaml", str(dl))).read_text())
    )
    assert recipe_back.fingerprint() == recipe.fingerprint()

    trial = client.get_run(t1)
    assert trial.data.tags["mlflow.parentRunId"] == session
    assert trial.data.tags["recompute.kind"] == "trial"
    assert trial.data.tags["recompute.outcome"] == "over_budget"
    assert trial.data.params == {
        "layer.blocks.0": "selective",
        "layer.blocks.1": "selective",
        "layer.blocks.2": "none",
        "layer.blocks.3": "none",
        "micro_batch": "8",
        "policy_fingerprint": mixed.fingerprint(),
        "trial_number": "1",
    }
    assert trial.data.metrics["measured_peak_bytes"] == 90 * 2**20
    assert trial.data.metrics["measured_throughput"] == 1500.0
    assert RecomputePolicy.load(client.download_artifacts(t1, "policy.yaml", str(dl / "t1"))) == mixed

    first = client.get_run(t0)
    assert first.info.status == "FINISHED"
    assert first.data.params["micro_batch"] == "default"
    assert first.data.metrics["predicted_peak_bytes"] == 11 * 2**20
    assert first.data.metrics["predicted_step_time_s"] == 0.002
    assert first.data.metrics["measured_step_time_s"] == pytest.approx(1 / 900)
    assert first.data.metrics["wall_s"] == 2.5
    assert [m.step for m in client.get_metric_history(t0, "step_time_s")] == [0, 1, 2]
    # The run spans the trial's own wall time, not the milliseconds logging took.
    assert first.info.end_time - first.info.start_time >= 2500

    oom = client.get_run(t2)
    assert oom.info.status == "FAILED"  # shows red in the UI; the outcome tag says why
    assert oom.data.tags["recompute.outcome"] == "oom"
    assert oom.data.tags["recompute.error"] == "CUDA out of memory"
    assert "stderr_tail.txt" in {f.path for f in client.list_artifacts(t2)}
    assert exp is not None and all(r.info.status != "RUNNING" for r in client.search_runs([exp.experiment_id]))


def test_layers_beyond_one_mlflow_batch_and_odd_pattern_names(uri: str, recipe: recipe_mod.Recipe) -> None:
    names = [f"model.layers.{i}" for i in range(130)]  # MLflow takes 100 params per batch
    with Tracker(uri, "tiny-exp") as tracker:
        tracker.sessions.start_session(recipe, study_name="s")
        big = tracker.sessions.log_trial(0, RecomputePolicy.every_kth(names, 2), names, None, ok(1, 1.0))
        # Without layer names the policy's own patterns are logged; MLflow forbids '[' and '*' in keys.
        globbed = tracker.sessions.log_trial(
            1,
            RecomputePolicy.from_dict({"version": 1, "layers": {"b.[0-1]": "full", "b.*": "none"}}),
            None,
            None,
            ok(1, 1.0),
        )
    client = MlflowClient(tracking_uri=uri)
    params = client.get_run(big).data.params
    assert sum(k.startswith("layer.") for k in params) == 130
    assert params["layer.model.layers.0"] == "full" and params["layer.model.layers.1"] == "none"
    assert {k: v for k, v in client.get_run(globbed).data.params.items() if k.startswith("layer.")} == {
        "layer.b._0-1_": "full",
        "layer.b._": "none",
    }


@pytest.mark.parametrize(("exc", "status"), [(RuntimeError("boom"), "FAILED"), (KeyboardInterrupt(), "KILLED")])
def test_an_exception_in_a_session_leaves_nothing_running(
    uri: str, recipe: recipe_mod.Recipe, exc: BaseException, status: str
) -> None:
    tracker = Tracker(uri, "tiny-exp")
    client = MlflowClient(tracking_uri=uri)
    with pytest.raises(type(exc)), tracker.sessions.session(recipe, study_name="s") as session:
        tracker.sessions.log_trial(0, RecomputePolicy.uniform("full"), LAYERS, None, ok(1, 1.0))
        # A nested run opened by hand and never ended, as a crash mid-logging would leave it.
        stray = client.create_run(tracker.store.experiment_id, tags={"mlflow.parentRunId": session}).info.run_id
        raise exc
    assert client.get_run(session).info.status == status
    assert client.get_run(stray).info.status == status
    assert [
        r.info.status for r in client.search_runs([tracker.store.experiment_id]) if r.info.status == "RUNNING"
    ] == []


def test_finish_session_ends_the_run_even_when_summary_logging_fails(uri: str, recipe: recipe_mod.Recipe) -> None:
    tracker = Tracker(uri, "tiny-exp")
    session = tracker.sessions.start_session(recipe, study_name="s")
    with pytest.raises(PolicyError, match="version"):
        # A best policy that is not a policy: the summary fails half way.
        tracker.sessions.finish_session(
            status="FINISHED", best={"policy": {"layers": {}}}, trials_table=[], baselines={}, budget_bytes=None
        )
    assert MlflowClient(tracking_uri=uri).get_run(session).info.status == "FINISHED"
    tracker.sessions.close("FAILED")  # idempotent: the run is already ended
    assert MlflowClient(tracking_uri=uri).get_run(session).info.status == "FINISHED"


def test_resume_reuses_the_unfinished_session_of_the_same_study(uri: str, recipe: recipe_mod.Recipe) -> None:
    client = MlflowClient(tracking_uri=uri)
    with pytest.raises(KeyboardInterrupt), Tracker(uri, "tiny-exp").sessions.session(recipe, study_name="s") as first:
        raise KeyboardInterrupt
    assert client.get_run(first).info.status == "KILLED"

    t1 = Tracker(uri, "tiny-exp")
    other = t1.sessions.start_session(recipe, study_name="another-study")
    assert other != first
    t1.sessions.close("FINISHED")

    tracker = Tracker(uri, "tiny-exp")
    with tracker.sessions.session(recipe, study_name="s") as resumed:
        assert resumed == first
        assert client.get_run(first).info.status == "RUNNING"
        tracker.sessions.log_trial(0, RecomputePolicy.uniform("full"), LAYERS, None, ok(5, 10.0))
        tracker.sessions.log_trial(1, RecomputePolicy.uniform("none"), LAYERS, None, ok(9, 20.0))
    run = client.get_run(first)
    assert run.info.status == "FINISHED"
    assert run.data.tags["recompute.resumes"] == "1"
    assert trial_numbers(uri, first) == [0, 1]

    # A finished session is history: the next one starts afresh; resume=False always does.
    with Tracker(uri, "tiny-exp").sessions.session(recipe, study_name="s") as fresh:
        assert fresh != first
    with Tracker(uri, "tiny-exp").sessions.session(recipe, study_name="s", resume=False) as forced:
        assert forced not in (first, fresh)


def test_concurrent_workers_on_one_study_get_their_own_session_runs(uri: str, recipe: recipe_mod.Recipe) -> None:
    client = MlflowClient(tracking_uri=uri)
    a, b = Tracker(uri, "tiny-exp"), Tracker(uri, "tiny-exp")
    run_a = a.sessions.start_session(recipe, study_name="shared")
    run_b = b.sessions.start_session(recipe, study_name="shared")
    assert run_a != run_b
    a.sessions.log_trial(0, RecomputePolicy.uniform("full"), LAYERS, None, ok(5, 10.0))
    a.sessions.close("FINISHED")
    # the first worker finishing does not close the second one's session under it
    assert client.get_run(run_b).info.status == "RUNNING"
    b.sessions.log_trial(1, RecomputePolicy.uniform("none"), LAYERS, None, ok(9, 20.0))
    b.sessions.close("FINISHED")
    assert trial_numbers(uri, run_b) == [1]


def test_resume_with_an_extended_recipe_records_the_change_instead_of_failing(
    uri: str, recipe: recipe_mod.Recipe
) -> None:
    tracker = Tracker(uri, "tiny-exp")
    session = tracker.sessions.start_session(recipe, study_name="s")
    tracker.sessions.close("KILLED")
    longer = recipe_mod.from_dict({**recipe.to_dict(), "search": {**recipe.to_dict()["search"], "n_trials": 99}})
    again = Tracker(uri, "tiny-exp")
    assert again.sessions.start_session(longer, study_name="s") == session
    again.sessions.close("FINISHED")
    run = MlflowClient(tracking_uri=uri).get_run(session)
    assert run.data.params["recipe.search.n_trials"] == "20"  # params are write-once
    assert run.data.tags["recompute.recipe_changed_on_resume"] == "recipe.search.n_trials"


def test_misuse_is_a_clear_error(uri: str, recipe: recipe_mod.Recipe) -> None:
    tracker = Tracker(uri, "tiny-exp")
    with pytest.raises(TrackingError, match="no open session"):
        tracker.sessions.log_trial(0, RecomputePolicy.uniform("full"), LAYERS, None, ok(1, 1.0))
    tracker.sessions.start_session(recipe, study_name="s")
    with pytest.raises(TrackingError, match="already open"):
        tracker.sessions.start_session(recipe, study_name="s")
    tracker.sessions.close("KILLED")
    client = MlflowClient(tracking_uri=uri)
    client.delete_experiment(tracker.store.experiment_id)
    with pytest.raises(TrackingError, match="is deleted; restore it"):
        Tracker(uri, "tiny-exp")


def test_artifact_location_follows_the_sqlite_database(tmp_path: Path) -> None:
    assert artifact_location_for(f"sqlite:///{tmp_path}/x/m.db", "my exp/1") == str(
        tmp_path / "x" / "mlartifacts" / "my_exp_1"
    )
    assert artifact_location_for("http://mlflow.internal:5000", "e") is None
    assert artifact_location_for("sqlite:///:memory:", "e") is None


# ---------------------------------------------------------------------------------------------- plots


def test_pareto_front_keeps_only_undominated_points() -> None:
    pts = [(10.0, 100.0), (5.0, 50.0), (10.0, 90.0), (20.0, 100.0), (20.0, 150.0), (5.0, 50.0), (1.0, 10.0)]
    assert pareto_front(pts) == [6, 1, 0, 4]
    assert pareto_front([]) == []


def test_pareto_plot_writes_a_png_with_baselines_and_budget(tmp_path: Path) -> None:
    import matplotlib.image

    rows = [
        {"number": 0, "outcome": "ok", "peak_bytes": 2**30, "throughput": 100.0, "throughput_unit": "tokens/s"},
        {"number": 1, "outcome": "over_budget", "peak_bytes": 3 * 2**30, "throughput": 140.0},
        {"number": 2, "outcome": "oom"},
        {"number": 3, "outcome": "ok", "peak_bytes": 2**29, "throughput": 70.0},
    ]
    out = pareto_plot(
        rows,
        tmp_path / "sub" / "p.png",
        budget_bytes=2 * 2**30,
        baselines={"none": {"outcome": "oom"}, "full": {"peak_bytes": 2**29, "throughput": 60.0}},
    )
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC
    h, w = matplotlib.image.imread(str(out)).shape[:2]
    assert (w, h) == (880, 605)  # 8 x 5.5 inches at 110 dpi
    # Nothing measured at all still gives a (labelled) plot rather than an exception.
    empty = pareto_plot([{"outcome": "error"}], tmp_path / "empty.png", budget_bytes=None)
    assert empty.read_bytes()[:8] == PNG_MAGIC


def test_a_decision_nests_in_the_open_session_run_and_in_none_after_it(
    uri: str, recipe: recipe_mod.Recipe, tmp_path: Path
) -> None:
    policy = RecomputePolicy.uniform("full")
    tracker = Tracker(uri, "tiny-exp")
    assert tracker.sessions.store is tracker.registry.store is tracker.store
    assert tracker.store.client is tracker.store.client
    with tracker.sessions.session(recipe, study_name="s") as session:
        inside = tracker.registry.reject(policy, source_run_id=None, reason="in the session", evidence={})
    outside = tracker.registry.promote(
        policy, source_run_id=None, output_path=tmp_path / "p.yaml", reason="after", evidence={}
    )
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(inside).data.tags["mlflow.parentRunId"] == session
    assert "mlflow.parentRunId" not in client.get_run(outside).data.tags
