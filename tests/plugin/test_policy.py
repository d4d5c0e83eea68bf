"""RecomputePolicy: parsing, serialisation, fingerprints and every bad-input message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_recompute import Mode, PolicyError, RecomputePolicy

LAYERS = [f"transformer.h.{i}" for i in range(6)]


def test_first_match_wins_and_unmatched_layers_keep_everything() -> None:
    p = RecomputePolicy.from_dict(
        {
            "version": 1,
            "layers": {"transformer.h.0": "none", "transformer.h.[1-3]": "selective", "transformer.h.4": "full"},
        }
    )
    assert p.resolve(LAYERS) == {
        "transformer.h.0": Mode.NONE,
        "transformer.h.1": Mode.SELECTIVE,
        "transformer.h.2": Mode.SELECTIVE,
        "transformer.h.3": Mode.SELECTIVE,
        "transformer.h.4": Mode.FULL,
        "transformer.h.5": Mode.NONE,
    }
    assert (
        RecomputePolicy(layers=(("*", Mode.FULL), ("transformer.h.0", Mode.NONE))).mode_for("transformer.h.0")
        is Mode.FULL
    )


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_file_round_trip_keeps_fingerprint(tmp_path: Path, suffix: str) -> None:
    p = RecomputePolicy(
        layers=(("transformer.h.0", Mode.NONE), ("transformer.h.*", Mode.FULL)), selective_save=("aten.mm", "aten.bmm")
    )
    path = p.save(tmp_path / f"policy{suffix}")
    loaded = RecomputePolicy.load(path)
    assert loaded == p and hash(loaded) == hash(p)
    assert loaded.fingerprint() == p.fingerprint()
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_fingerprint_depends_on_content_and_order() -> None:
    a = RecomputePolicy.from_modes({"x.0": "full", "x.1": "none"})
    assert a.fingerprint() == RecomputePolicy.from_modes({"x.0": "full", "x.1": "none"}).fingerprint()
    assert a.fingerprint() != RecomputePolicy.from_modes({"x.1": "none", "x.0": "full"}).fingerprint()
    assert a.fingerprint() != RecomputePolicy.from_modes({"x.0": "selective", "x.1": "none"}).fingerprint()
    assert len(a.fingerprint()) == 16


def test_shape_helpers() -> None:
    assert RecomputePolicy.every_kth(LAYERS, 2).short(LAYERS) == "F.F.F."
    assert RecomputePolicy.every_kth(LAYERS, 3, "selective", offset=1).short(LAYERS) == ".s..s."
    assert RecomputePolicy.first_n(LAYERS, 4).short(LAYERS) == "FFFF.."
    assert RecomputePolicy.uniform("offload").short(LAYERS) == "oooooo"
    with pytest.raises(PolicyError, match="k: must be a positive integer"):
        RecomputePolicy.every_kth(LAYERS, 0)


def test_describe_is_a_table_per_layer() -> None:
    text = RecomputePolicy.first_n(LAYERS, 1).describe(LAYERS)
    lines = text.splitlines()
    assert lines[0].split() == ["layer", "mode"]
    assert lines[2].split() == ["transformer.h.0", "full"]
    assert lines[3].split() == ["transformer.h.1", "none"]
    assert "selective saves: default" in lines[-1]


def _write(tmp_path: Path, text: str, name: str = "policy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        (
            "version: 1\nlayers:\n  h.0: fast\n",
            r"policy\.yaml: layers\.h\.0: unknown mode 'fast'; valid modes are: none, selective, full, offload",
        ),
        ("version: 2\nlayers: {}\n", r"policy\.yaml: key 'version': unsupported policy version 2; valid: 1"),
        ("layers: {h.0: full}\n", r"policy\.yaml: missing key 'version'"),
        ("version: 1\nlayers: {h.0: full\n", r"policy\.yaml: malformed YAML"),
        (
            "version: 1\nlayer: {h.0: full}\n",
            r"policy\.yaml: unknown key\(s\) \['layer'\]; "
            r"valid keys are \['version', 'layers', 'selective', 'compile', 'tuned_for'\]",
        ),
        ("version: 1\nlayers: [full]\n", r"policy\.yaml: key 'layers' must map layer paths"),
        ("", r"policy\.yaml: policy file is empty"),
        (
            "version: 1\nselective: {save: [aten.not_an_op]}\n",
            r"policy\.yaml: selective\.save: unknown op 'aten.not_an_op'",
        ),
        (
            "version: 1\nselective: {save: [aten.native_dropout]}\n",
            r"selective\.save: op 'aten.native_dropout' draws random numbers",
        ),
        (
            "version: 1\nselective: {keep: [aten.mm]}\n",
            r"policy\.yaml: key 'selective' must be a mapping with the single key 'save'",
        ),
    ],
)
def test_bad_files_name_file_key_and_valid_choices(tmp_path: Path, text: str, pattern: str) -> None:
    with pytest.raises(PolicyError, match=pattern):
        RecomputePolicy.load(_write(tmp_path, text))


def test_missing_file_and_malformed_json(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"nope\.yaml: policy file not found"):
        RecomputePolicy.load(tmp_path / "nope.yaml")
    with pytest.raises(PolicyError, match=r"p\.json: malformed JSON"):
        RecomputePolicy.load(_write(tmp_path, '{"version": 1,', "p.json"))


def test_unmatched_pattern_names_it_and_lists_layers() -> None:
    p = RecomputePolicy.from_modes({"transformer.h.0": "full", "model.layers.*": "full"})
    with pytest.raises(PolicyError) as err:
        p.resolve(LAYERS, source="run.yaml")
    assert "run.yaml: layer pattern(s) ['model.layers.*'] match no layer" in str(err.value)
    assert "transformer.h.0, transformer.h.1" in str(err.value)


def test_policy_is_immutable() -> None:
    p = RecomputePolicy.uniform("full")
    with pytest.raises(AttributeError):
        p.layers = ()  # type: ignore[misc]


def test_saved_policy_is_readable_by_others_and_keeps_an_existing_mode(tmp_path: Path) -> None:
    import os
    import stat

    path = RecomputePolicy.uniform("full").save(tmp_path / "policy.yaml")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    path.chmod(0o640)
    RecomputePolicy.uniform("none").save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert RecomputePolicy.load(path) == RecomputePolicy.uniform("none")


@pytest.mark.parametrize(
    ("name", "data", "pattern"),
    [
        ("policy.yaml", "version: 1\n".encode("utf-16"), r"policy\.yaml: policy file is UTF-16 text"),
        ("policy.yaml", bytes(range(256)) * 4, r"policy\.yaml: policy file contains NUL bytes"),
        (
            "policy.yaml",
            b"[" * 100_000 + b"]" * 100_000,
            # libyaml's scanner reads ahead and may refuse first, at its own limit of 1,000 flow levels.
            r"policy\.yaml: (nested deeper than 64 levels|malformed YAML: [\s\S]*exceeded maximum nesting depth)",
        ),
        ("policy.json", b"[" * 100_000 + b"]" * 100_000, r"policy\.json: nested deeper than 64 levels"),
        (
            "policy.yaml",
            (
                "a0: &a0 [full, full, full, full, full, full, full, full, full]\n"
                + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9))
            ).encode(),
            r"policy\.yaml: YAML aliases expand to more than 10000 nodes",
        ),
        ("policy.yaml", b"version: 1\n# " + b"x" * (1 << 20), r"policy\.yaml: policy file is larger than the limit"),
    ],
)
def test_hostile_files_are_policy_errors(tmp_path: Path, name: str, data: bytes, pattern: str) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(PolicyError, match=pattern):
        RecomputePolicy.load(path)


def test_echoed_values_are_clipped(tmp_path: Path) -> None:
    huge = "x" * 100_000
    for data in (
        {"version": 1, "layers": {"h.0": huge}},  # an unknown mode
        {"version": 1, "layers": {huge: "fast"}},  # in the key the message names
        {"version": 1, huge: 1},  # an unknown top-level key
        {"version": huge},
        {"version": 1, "selective": {"save": huge}},
    ):
        with pytest.raises(PolicyError) as info:
            RecomputePolicy.load(_write(tmp_path, json.dumps(data), "policy.json"))
        assert len(str(info.value)) < 1000, str(info.value)[:300]
        assert "characters)" in str(info.value)
    with pytest.raises(PolicyError) as info:
        RecomputePolicy.from_modes({"h.0": "full", huge: "full"}).resolve(LAYERS)
    assert len(str(info.value)) < 1000
