"""Byte sizes, seconds and JSON-ready values (`jsonable`), read and printed one way by the plugin and the tuner."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from datetime import datetime
from typing import Any

from lightning_recompute.errors import clip

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_UNITS = {"": 1, "b": 1}
for _power, _prefix in enumerate("kmgt", start=1):
    _UNITS.update({_prefix: 1000**_power, f"{_prefix}b": 1000**_power, f"{_prefix}ib": 1024**_power})


def parse_bytes(value: int | float | str) -> int:
    """Bytes from a positive whole number or a size string, case-insensitive: ``"20GiB"`` (1024-based), ``"20GB"``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value >= 1 and (isinstance(value, int) or value.is_integer()):  # inf and nan are not integers
            return int(value)
        raise ValueError(f"a number of bytes must be a positive whole number, got {value!r}")
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    if m and m.group(2).lower() in _UNITS:
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if not math.isfinite(n):  # "1e400MiB": a float overflows to inf, and int(inf) raises OverflowError
            raise ValueError(f"{clip(repr(value))} is not a finite size")
        if n >= 1:
            return int(n)
    raise ValueError(
        f"{clip(repr(value))} is not a size (valid: a number of bytes, or a number with a unit: "
        f"B, KiB, MiB, GiB, TiB (1024-based) or KB, MB, GB, TB (1000-based), e.g. 20GiB)"
    )


def format_bytes(n: float | None) -> str:
    """Bytes in binary units with two decimals (``20.00 GiB``); ``None`` and non-finite numbers are ``n/a``."""
    if n is None or isinstance(n, bool) or not math.isfinite(n):
        return "n/a"
    power = 0
    while abs(n) >= 1024 ** (power + 1) and power < 4:
        power += 1
    return f"{int(n)} B" if power == 0 else f"{n / 1024**power:.2f} {('KiB', 'MiB', 'GiB', 'TiB')[power - 1]}"


def format_seconds(s: float) -> str:
    """Seconds with a unit that keeps three significant figures: ``1.234 s``, ``12.35 ms``, ``80.0 us``."""
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def jsonable(value: Any) -> Any:
    """A JSON-ready copy of results, policies, paths, dataclasses and mappings (non-finite floats become null)."""
    if hasattr(value, "to_dict") and callable(value.to_dict):
        return jsonable(value.to_dict())
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return value.isoformat() if isinstance(value, datetime) else str(value)
