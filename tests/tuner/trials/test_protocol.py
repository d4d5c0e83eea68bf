"""The worker's spec protocol: every kind through JSON and back, and what a worker refuses to read."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tuner._trials import protocol as P

RECIPE = {"trainer": {"accelerator": "cpu", "devices": 2}, "model": {"init_args": {"n_layer": 2}}}
POLICY = {"version": 1, "default": "full", "layers": {}}
COMMON: dict[str, Any] = {"deadline": 1234.5, "sys_path": ("/work", "/recipes")}
RECIPE_FIELDS: dict[str, Any] = {**COMMON, "recipe": RECIPE, "source": "/recipes/r.yaml", "micro_batch": 4}

SPECS: dict[str, P.Spec] = {
    "trial": P.TrialSpec(**RECIPE_FIELDS, policy=POLICY, warmup_steps=1, measure_steps=3),
    "numerics": P.NumericsSpec(**RECIPE_FIELDS, policy=POLICY),
    "device": P.DeviceSpec(**COMMON, accelerator="cuda"),
    "profile": P.ProfileSpec(**RECIPE_FIELDS, repeats=3),
    "race": P.RaceSpec(
        **RECIPE_FIELDS,
        entrants=(P.RaceEntrant(key="abc", policy=POLICY, short="FF"), P.RaceEntrant(key="def", policy={}, short="..")),
        references=("def",),
        budget_bytes=1 << 30,
        plan={"time_s": 60.0, "min_rounds": 3},
    ),
}


def test_every_kind_has_a_round_trip_case() -> None:
    assert tuple(SPECS) == tuple(P.SPEC_TYPES)
    assert [kind for kind, cls in P.SPEC_TYPES.items() if cls.ranked] == ["trial", "numerics"]


@pytest.mark.parametrize("kind", list(P.SPEC_TYPES))
def test_every_spec_kind_survives_json(kind: str) -> None:
    spec = SPECS[kind]
    data = json.loads(json.dumps(spec.to_dict()))
    assert data["kind"] == kind
    assert P.parse_spec(data) == spec
    assert type(spec).of(data) == spec and type(spec).of(spec) is spec


def test_ranks_are_the_recipes_devices_for_the_ranked_kinds_only() -> None:
    assert {kind: spec.ranks for kind, spec in SPECS.items()} == {
        "trial": 2,
        "numerics": 2,
        "device": 1,
        "profile": 1,
        "race": 1,
    }
    assert P.TrialSpec(recipe={}, policy={}, warmup_steps=0, measure_steps=1).ranks == 1
    assert SPECS["trial"].runs_on == "cpu" and SPECS["device"].runs_on == "cuda"


def test_the_wire_keys_are_those_a_spec_had_before_it_was_typed() -> None:
    # Tests and older tools write specs as plain dicts: these keys (no kind, no version) still parse.
    legacy = {"recipe": RECIPE, "policy": POLICY, "warmup_steps": 1, "measure_steps": 2}
    spec = P.TrialSpec.of(legacy)
    assert (spec.source, spec.micro_batch, spec.sys_path, spec.deadline) == (None, None, (), None)
    assert set(SPECS["trial"].to_dict()) == {*legacy, *("kind", "deadline", "sys_path", "source", "micro_batch")}
    race = SPECS["race"].to_dict()
    wire = {"kind", "entrants", "references", "budget_bytes", "plan"}
    assert set(race) - set(RECIPE_FIELDS) == wire
    assert race["entrants"][0] == {"key": "abc", "policy": POLICY, "short": "FF"}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"kind": "bogus"}, "unknown spec kind 'bogus'; valid: trial, numerics, device, profile, race"),
        ({"accelerator": "cpu"}, "unknown spec kind None; valid: trial, numerics, device, profile, race"),
        (["trial"], "a spec is a JSON object, got list"),
        ({"kind": "device", "accelerator": "cpu", "gpus": 1}, "device spec: gpus: Extra inputs are not permitted"),
        ({"kind": "numerics", "recipe": RECIPE}, "numerics spec: policy: Field required"),
        ({"kind": "profile", "recipe": RECIPE, "repeats": "x"}, "profile spec: repeats: Input should be a valid int"),
        ({"kind": "profile", "recipe": [], "repeats": 1}, "profile spec: recipe: Input should be a valid dictionary"),
        (
            {"kind": "race", "recipe": RECIPE, "entrants": [{"key": "a"}]},
            "race spec: entrants.0.policy: Field required; entrants.0.short: Field required",
        ),
    ],
)
def test_a_spec_the_worker_cannot_read_says_what_and_what_it_supports(data: Any, message: str) -> None:
    with pytest.raises(P.ProtocolError) as err:
        P.parse_spec(data)
    assert str(err.value).startswith(message), str(err.value)


def test_a_spec_of_another_kind_is_refused() -> None:
    with pytest.raises(P.ProtocolError, match=r"unknown spec kind 'numerics'; valid: trial$"):
        P.TrialSpec.of(SPECS["numerics"].to_dict())


def test_each_rank_writes_its_own_result() -> None:
    from pathlib import Path

    assert P.rank_result_path(Path("/t/result.json"), 1) == Path("/t/result.rank1.json")


def test_the_worker_runs_every_kind_and_no_other() -> None:
    from tuner._trials import worker

    assert set(worker._HANDLERS) == set(P.SPEC_TYPES.values())


@pytest.mark.parametrize(
    ("data", "error"),
    [
        ({**SPECS["trial"].to_dict(), "gpus": 2}, "ProtocolError: trial spec: gpus: Extra inputs are not permitted"),
        ({"kind": "train"}, "ProtocolError: unknown spec kind 'train'; valid: trial, numerics, device"),
    ],
)
def test_a_worker_given_a_spec_it_cannot_read_writes_an_error_naming_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, data: dict[str, Any], error: str
) -> None:
    from tuner._trials import worker

    # main() sets it to this process's pid for its ranks. setenv, not delenv: deleting an unset variable
    # records nothing to undo, and the pid left behind once ended this process in a later in-process main().
    monkeypatch.setenv(P.PARENT_PID_ENV, "")
    spec, result = tmp_path / "spec.json", tmp_path / "result.json"
    spec.write_text(json.dumps(data), encoding="utf-8")
    assert worker.main([str(spec), str(result)]) == 1
    written = json.loads(result.read_text(encoding="utf-8"))
    assert (written["outcome"], written["rank"]) == ("error", 0)
    assert written["error"].startswith(error), written["error"]


def test_a_worker_run_in_the_process_that_started_workers_does_not_take_itself_for_its_dead_parent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tuner._trials import worker

    # What main() leaves in os.environ for the ranks it may start: this process's own pid. A second
    # main() in the same process must not read that as "my parent died" and exit.
    monkeypatch.setenv(P.PARENT_PID_ENV, str(os.getpid()))
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    worker.die_with_parent(str(os.getpid()))
    assert exits == []
