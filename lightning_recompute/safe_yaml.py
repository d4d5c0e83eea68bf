"""Bounded reading of YAML/JSON from outside (policy files, recipes): ``yaml.safe_load`` alone allows alias bombs,
stack-overflowing nesting and raw decode errors; here each is one `DocumentError` naming the file.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from lightning_recompute.errors import DocumentError, clip

MAX_BYTES = 1 << 20  # a policy for 10,000 layers is about 400 KB
MAX_DEPTH = 64  # of mappings and sequences; a policy nests 3 deep, a recipe about 6
MAX_ALIAS_NODES = 10_000  # nodes YAML aliases may add when expanded, aliases inside anchors counted

# libyaml when PyYAML was built with it: faster, same results.
_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# A JSON string literal, or one bracket: what the JSON depth scan needs to see.
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)

# UTF-32's little-endian mark starts with UTF-16's: test it first.
_BOMS = {"UTF-32": (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE), "UTF-16": (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)}


def load_document(path: str | os.PathLike[str], *, what: str = "file") -> Any:
    """The data in a regular YAML file (JSON by its ``.json`` suffix), ``None`` when empty."""
    p = Path(path)
    return parse_document(read_text(p, what=what), source=str(p), json_syntax=p.suffix.lower() == ".json")


def parse_document(text: str, *, source: str, json_syntax: bool = False) -> Any:
    """`load_document` for text already in memory; ``source`` names it in messages."""
    if len(text) > MAX_BYTES:
        raise DocumentError(f"{source}: {len(text)} characters, over the limit of {MAX_BYTES}")
    try:
        if json_syntax:
            _check_json_depth(text, source)
            return json.loads(text)
        _check_yaml_shape(text, source)
        return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader: no arbitrary objects
    except DocumentError:
        raise
    except (yaml.YAMLError, ValueError) as err:  # ValueError: int() past sys.get_int_max_str_digits()
        raise DocumentError(f"{source}: malformed {'JSON' if json_syntax else 'YAML'}: {clip(str(err))}") from None


def read_text(path: str | os.PathLike[str], *, what: str = "file") -> str:
    """The UTF-8 text of a regular file of at most `MAX_BYTES`: `load_document`'s reading step alone."""
    try:
        # O_NONBLOCK: opening a FIFO without a writer would otherwise block before fstat can refuse it.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise DocumentError(f"{path}: {what} is not a regular file")
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise DocumentError(f"{path}: {what} not found") from None
    except OSError as err:
        raise DocumentError(f"{path}: cannot read {what}: {err.strerror}") from None
    if len(raw) > MAX_BYTES:
        raise DocumentError(f"{path}: {what} is larger than the limit of {MAX_BYTES} bytes")
    for encoding, boms in _BOMS.items():
        if raw.startswith(boms):
            raise DocumentError(f"{path}: {what} is {encoding} text; save it as UTF-8")
    if b"\x00" in raw:
        raise DocumentError(
            f"{path}: {what} contains NUL bytes: a binary file, or UTF-16/UTF-32 text; expected UTF-8 text"
        )
    try:
        return raw.decode("utf-8-sig")  # -sig: a UTF-8 byte-order mark is harmless; drop it
    except UnicodeDecodeError as err:
        raise DocumentError(
            f"{path}: {what} is not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start})"
        ) from None


def _check_yaml_shape(text: str, source: str) -> None:
    """Refuse deep nesting and alias expansion from the event stream, before anything is built (each anchor's
    expanded size is known when it ends, so an alias costs O(1) and a bomb fails at once)."""
    frames: list[tuple[str | None, list[int]]] = []  # open collections: (anchor, [expanded size])
    sizes: dict[str, int] = {}  # closed anchors -> expanded size
    added = 0  # nodes added by aliases so far
    for event in yaml.parse(text, Loader=_Loader):
        line = event.start_mark.line + 1
        if isinstance(event, yaml.CollectionStartEvent):
            if len(frames) >= MAX_DEPTH:
                raise DocumentError(f"{source}: nested deeper than {MAX_DEPTH} levels (line {line})")
            frames.append((event.anchor, [1]))
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            anchor, (size,) = frames.pop()
        elif isinstance(event, yaml.ScalarEvent):
            anchor, size = event.anchor, 1
        elif isinstance(event, yaml.AliasEvent):
            alias = clip(event.anchor or "")
            if any(event.anchor == open_anchor for open_anchor, _ in frames):
                raise DocumentError(
                    f"{source}: alias *{alias} refers to a collection that contains it (line {line}); "
                    f"recursive documents are not accepted"
                )
            anchor, size = None, sizes.get(event.anchor or "", 1)
            added += size
            if added > MAX_ALIAS_NODES:
                raise DocumentError(
                    f"{source}: YAML aliases expand to more than {MAX_ALIAS_NODES} nodes (at *{alias}, line {line}); "
                    f"write the values out or use fewer aliases"
                )
        else:
            continue
        if anchor is not None:
            sizes[anchor] = size
        if frames:
            frames[-1][1][0] += size


def _check_json_depth(text: str, source: str) -> None:
    # json.loads recurses per level; refuse depth first so it cannot hit the interpreter's limit.
    depth = 0
    for match in _JSON_TOKENS.finditer(text):
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(match.group(), 0)
        if depth > MAX_DEPTH:
            line = text.count("\n", 0, match.start()) + 1
            raise DocumentError(f"{source}: nested deeper than {MAX_DEPTH} levels (line {line})")
