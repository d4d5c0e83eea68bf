"""`Profile.describe`, the per-layer table `recompute-tune plan` prints: every column filled, and no
layer name or mode header running into the next column."""

from __future__ import annotations

from lightning_recompute.profile import LayerProfile, Profile, SegmentCost
from lightning_recompute.units import format_bytes

MODES = ["none", "selective", "full", "selective:attn+narrow"]


def _profile(names: list[str]) -> Profile:
    layers = [
        LayerProfile(
            name=name,
            group="g",
            param_bytes=0,
            fwd={m: SegmentCost(delta=(4 - j) * 1_000_000 + i, seconds=(i + 1) * 1e-3) for j, m in enumerate(MODES)},
            bwd={m: SegmentCost(seconds=(j + 2) * 1e-3) for j, m in enumerate(MODES)},
            net=0,
        )
        for i, name in enumerate(names)
    ]
    timeline = [f"fwd:{i}" for i in range(len(names))] + [f"bwd:{i}" for i in reversed(range(len(names)))]
    return Profile(layers, timeline, {}, MODES, 10**6, 0, 0, 0, 0, 1, "cpu", "measured")


def _table(prof: Profile) -> tuple[str, list[str]]:
    lines = prof.describe().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layer"))
    return lines[start], lines[start + 1 : start + 1 + len(prof.layers)]


def test_every_mode_column_is_filled_under_its_header() -> None:
    prof = _profile(["blocks.0", "blocks.1"])
    header, rows = _table(prof)
    for layer, row in zip(prof.layers, rows, strict=True):
        for m in MODES:
            kept_end = header.index(f"{m} kept") + len(f"{m} kept")
            ms_end = header.index(f"{m} ms") + len(f"{m} ms")
            kept = format_bytes(layer.fwd[m].delta)
            ms = f"{1e3 * (layer.fwd[m].seconds + layer.bwd[m].seconds):.3f}"
            # right-aligned under its header, with at least two spaces before it
            assert row[:kept_end].endswith("  " + kept), (m, row)
            assert row[:ms_end].endswith("  " + ms), (m, row)
        assert len(row.rstrip()) == len(header)


def test_long_layer_names_and_mode_headers_leave_two_spaces_before_the_next_column() -> None:
    names = ["model.model.layers.0", "model.model.layers.10", "model.model.decoder.layers.100"]
    prof = _profile(names)
    header, rows = _table(prof)
    for name, row in zip(names, rows, strict=True):
        assert row.startswith(name + "  "), row
        assert row[len(name) :].startswith("  "), row
    # every header label is preceded by at least two spaces
    for m in MODES:
        for label in (f"{m} kept", f"{m} ms"):
            at = header.index(label)
            assert header[at - 2 : at] == "  ", (label, header)
