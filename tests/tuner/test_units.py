"""lightning_recompute.units: the one parser and the one printer of sizes, and the seconds printer."""

from __future__ import annotations

import math

import pytest

from lightning_recompute.units import format_bytes, format_seconds, parse_bytes


def test_parse_bytes_reads_binary_and_decimal_units_case_insensitively() -> None:
    assert parse_bytes("20GiB") == 20 * 2**30
    assert parse_bytes("80 GB") == 80 * 10**9
    assert parse_bytes("1.5mib") == 1536 * 1024
    assert parse_bytes("1KiB") == 1024 and parse_bytes("1kb") == 1000
    assert parse_bytes("512") == 512
    assert parse_bytes(4096) == 4096
    assert parse_bytes(4096.0) == 4096


@pytest.mark.parametrize("zero", [0, 0.0, "0", "0GiB", "0 B"])
def test_zero_is_not_a_size(zero: object) -> None:
    # The one zero rule: every size the tuner reads is a budget or a limit, and zero bytes is neither.
    with pytest.raises(ValueError, match=r"positive|not a size"):
        parse_bytes(zero)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["20 gigs", "", "GiB", "-1GiB", "1 GiBs", True, -5, 1.5, math.inf, None])
def test_parse_bytes_rejects_what_is_not_a_size_and_names_the_units(bad: object) -> None:
    with pytest.raises(ValueError, match=r"GiB|positive"):
        parse_bytes(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("huge", ["1e400MiB", "1e400", "9" * 400 + "GiB"])
def test_an_overflowing_size_is_a_clear_error_not_an_overflow(huge: str) -> None:
    # float("1e400") is inf; int(inf) would raise OverflowError, which no caller expects.
    with pytest.raises(ValueError, match="not a finite size") as info:
        parse_bytes(huge)
    assert len(str(info.value)) < 300  # the echoed value is clipped


def test_format_bytes() -> None:
    assert format_bytes(20 * 2**30) == "20.00 GiB"
    assert format_bytes(1536 * 1024) == "1.50 MiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(-2048) == "-2.00 KiB"
    assert format_bytes(None) == "n/a" and format_bytes(math.nan) == "n/a"


def test_format_seconds() -> None:
    assert format_seconds(1.23456) == "1.235 s"
    assert format_seconds(0.0123456) == "12.35 ms"
    assert format_seconds(80e-6) == "80.0 us"
