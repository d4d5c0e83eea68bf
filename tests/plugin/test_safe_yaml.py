"""lightning_recompute.safe_yaml: hostile or broken YAML/JSON fails as one DocumentError, within bounds."""

from __future__ import annotations

import os
import re
import tracemalloc
from pathlib import Path

import pytest

from lightning_recompute import safe_yaml
from lightning_recompute.errors import CLIP_CHARS, DocumentError, RecomputeError, clip
from lightning_recompute.safe_yaml import load_document, parse_document


def alias_bomb(levels: int = 9) -> str:
    """The "billion laughs": each level is 9 aliases of the one before, 9**levels strings in all."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def write(tmp_path: Path, data: str | bytes, name: str = "doc.yaml") -> Path:
    path = tmp_path / name
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8")
    return path


def test_plain_documents_round_trip_with_anchors_and_merge_keys(tmp_path: Path) -> None:
    text = "base: &b {x: 1, y: [1, 2]}\nother: *b\nmerged: {<<: *b, z: 3}\n"
    assert load_document(write(tmp_path, text)) == {
        "base": {"x": 1, "y": [1, 2]},
        "other": {"x": 1, "y": [1, 2]},
        "merged": {"x": 1, "y": [1, 2], "z": 3},
    }
    assert load_document(write(tmp_path, '{"a": ["[[", {"b": null}]}', "doc.json")) == {"a": ["[[", {"b": None}]}
    assert load_document(write(tmp_path, "")) is None
    assert load_document(write(tmp_path, b"\xef\xbb\xbfa: 1\n")) == {"a": 1}  # a UTF-8 byte-order mark is fine


def test_alias_bomb_is_refused_at_its_first_over_limit_alias(tmp_path: Path) -> None:
    path = write(tmp_path, alias_bomb())
    assert path.stat().st_size < 1024
    tracemalloc.start()
    try:
        with pytest.raises(DocumentError) as info:
            load_document(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert message.startswith(f"{path}: YAML aliases expand to more than 10000 nodes")
    # Levels 1-3 add 90 + 819 + 7,380 nodes; the first alias on line 5 (*a3, 7,381 nodes) crosses 10,000.
    assert "(at *a3, line 5)" in message
    assert peak < 16 * 2**20  # the 9**9 strings were never built


def test_alias_expansion_limit_counts_aliases_inside_anchors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(safe_yaml, "MAX_ALIAS_NODES", 100)
    # 9 aliases of a 10-node list add 90 nodes; the next level's first alias adds 91 more.
    assert len(load_document(write(tmp_path, alias_bomb(levels=2)))["a1"]) == 9
    with pytest.raises(DocumentError, match=r"aliases expand to more than 100 nodes \(at \*a1, line 3\)"):
        load_document(write(tmp_path, alias_bomb(levels=3)))


def test_recursive_alias_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DocumentError, match=r"alias \*a refers to a collection that contains it \(line 1\)"):
        load_document(write(tmp_path, "a: &a [1, *a]\n"))


@pytest.mark.parametrize(("name", "opening", "closing"), [("doc.yaml", "[", "]"), ("doc.json", "[", "]")])
def test_100k_deep_nesting_is_refused_without_recursion(tmp_path: Path, name: str, opening: str, closing: str) -> None:
    path = write(tmp_path, opening * 100_000 + closing * 100_000, name)
    # libyaml's scanner reads ahead and may refuse first, at its own limit of 1,000 flow levels.
    refused = r"nested deeper than 64 levels \(line 1\)$|malformed YAML: [\s\S]*exceeded maximum nesting depth"
    with pytest.raises(DocumentError, match=rf"^{re.escape(str(path))}: ({refused})"):
        load_document(path)
    deep_mapping = "".join(f"{' ' * (2 * i)}k{i}:\n" for i in range(70)) + " " * 140 + "leaf: 1\n"
    with pytest.raises(DocumentError, match=r"nested deeper than 64 levels \(line 65\)"):
        load_document(write(tmp_path, deep_mapping))
    assert load_document(write(tmp_path, "[" * 64 + "]" * 64)) is not None


def test_nesting_limit_ignores_brackets_inside_json_strings(tmp_path: Path) -> None:
    text = '{"a": "' + "[" * 1000 + '", "b": "\\"{{{{"}'
    assert load_document(write(tmp_path, text, "doc.json")) == {"a": "[" * 1000, "b": '"{{{{'}


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ("version: 1\n".encode("utf-16"), r"doc\.yaml: policy file is UTF-16 text; save it as UTF-8"),
        ("version: 1\n".encode("utf-32"), r"doc\.yaml: policy file is UTF-32 text; save it as UTF-8"),
        ("version: 1\n".encode("utf-16-le"), r"doc\.yaml: policy file contains NUL bytes: a binary file, or UTF-16"),
        (bytes(range(256)), r"doc\.yaml: policy file contains NUL bytes"),
        (b"version: caf\xe9\n", r"doc\.yaml: policy file is not UTF-8 text \(byte 0xe9 at offset 12\)"),
    ],
)
def test_binary_and_non_utf8_files_are_refused(tmp_path: Path, data: bytes, pattern: str) -> None:
    with pytest.raises(DocumentError, match=pattern):
        load_document(write(tmp_path, data), what="policy file")


def test_oversized_file_is_refused_before_parsing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "a: " + "x" * 2000 + "\n")
    monkeypatch.setattr(safe_yaml, "MAX_BYTES", 2004)
    assert load_document(path) == {"a": "x" * 2000}
    monkeypatch.setattr(safe_yaml, "MAX_BYTES", 1000)
    with pytest.raises(DocumentError, match=r"doc\.yaml: recipe is larger than the limit of 1000 bytes"):
        load_document(path, what="recipe")
    with pytest.raises(DocumentError, match="2004 characters, over the limit of 1000"):
        parse_document(path.read_text(), source="inline")


def test_missing_directory_and_special_files(tmp_path: Path) -> None:
    with pytest.raises(DocumentError, match=r"nope\.yaml: policy file not found"):
        load_document(tmp_path / "nope.yaml", what="policy file")
    with pytest.raises(DocumentError, match=r"is not a regular file"):
        load_document(tmp_path)
    if hasattr(os, "mkfifo"):  # a FIFO with no writer would block a plain open() forever
        os.mkfifo(tmp_path / "fifo.yaml")
        with pytest.raises(DocumentError, match=r"fifo\.yaml: file is not a regular file"):
            load_document(tmp_path / "fifo.yaml")


def test_malformed_documents_and_huge_integers(tmp_path: Path) -> None:
    with pytest.raises(DocumentError, match=r"doc\.yaml: malformed YAML"):
        load_document(write(tmp_path, "a: {b: 1\n"))
    with pytest.raises(DocumentError, match=r"doc\.json: malformed JSON"):
        load_document(write(tmp_path, '{"a": 1,', "doc.json"))
    # int() refuses more than 4300 digits (CVE-2020-10735): a ValueError that must not escape raw.
    with pytest.raises(DocumentError, match=r"malformed YAML: Exceeds the limit"):
        load_document(write(tmp_path, "a: " + "9" * 5000 + "\n"))
    with pytest.raises(DocumentError, match=r"malformed JSON: Exceeds the limit"):
        load_document(write(tmp_path, '{"a": ' + "9" * 5000 + "}", "doc.json"))


def test_errors_are_recompute_errors_and_clip_echoed_content(tmp_path: Path) -> None:
    huge_line = "a: [" + "x" * 100_000 + "\n"  # unclosed: the parser quotes the line
    with pytest.raises(DocumentError) as info:
        load_document(write(tmp_path, huge_line))
    assert isinstance(info.value, RecomputeError) and isinstance(info.value, ValueError)
    assert len(str(info.value)) < len(str(tmp_path)) + 300
    assert clip("x" * 1000) == "x" * CLIP_CHARS + "... (1000 characters)"
    assert clip("short") == "short"
