"""The tables `recompute-tune plan` prints: `format_front`'s mode-count header names every count a row
prints, in the order it prints them; `Prediction.describe` leaves room after long layer names and modes."""

from __future__ import annotations

from lightning_recompute.planner import Planner, format_front
from lightning_recompute.profile import ALL_MODES, LayerProfile, Profile, SegmentCost

MODES = ["none", "selective", "full", "selective:attn", "selective:attn+narrow"]
KEPT = {"none": 1000, "selective": 600, "full": 100, "selective:attn": 800, "selective:attn+narrow": 400}
SECONDS = {"none": 1.0, "selective": 1.1, "full": 1.4, "selective:attn": 1.02, "selective:attn+narrow": 1.2}


def _profile(n: int = 4, prefix: str = "blocks.") -> Profile:
    layers = [
        LayerProfile(
            name=f"{prefix}{i}",
            group="g",
            param_bytes=0,
            fwd={m: SegmentCost(delta=KEPT[m] * 1000, peak=KEPT[m] * 1000, seconds=SECONDS[m] / 3) for m in MODES},
            bwd={m: SegmentCost(seconds=2 * SECONDS[m] / 3) for m in MODES},
            net=0,
        )
        for i in range(n)
    ]
    timeline = [f"fwd:{i}" for i in range(n)] + [f"bwd:{i}" for i in reversed(range(n))]
    return Profile(layers, timeline, {}, MODES, 10**6, 0, 0, 0, 0, 1, "cpu", "measured")


def test_the_count_header_names_every_count_of_every_row() -> None:
    front = Planner(_profile()).pareto_front()
    assert len(front) > 2
    lines = format_front(front, {"budget": 10**7}).splitlines()
    header, rows = lines[0], lines[2 : 2 + len(front)]
    [label] = [token for token in header.split() if "/" in token]
    names = label.split("/")
    assert len(names) == len(ALL_MODES) == len(set(names))
    assert names[:4] == ["none", "sel", "full", "off"]
    end = header.index(label) + len(label)
    seen = set()
    for plan, row in zip(front, rows, strict=True):
        cell = row[:end].split()[-1]
        counts = [int(c) for c in cell.split("/")]
        assert len(counts) == len(names), (header, row)
        # each count sits under its name: the plan's layers in that mode
        assert counts == [sum(1 for m in plan.modes.values() if m == mode) for mode in ALL_MODES]
        assert sum(counts) == len(plan.modes)
        seen |= {name for name, c in zip(names, counts, strict=True) if c}
    assert "attn" in seen or "attn+narrow" in seen  # the family counts are exercised, not all zero


def test_the_chosen_policy_table_leaves_two_spaces_after_long_names_and_modes() -> None:
    prof = _profile(n=12, prefix="model.model.layers.")
    modes = {layer.name: MODES[i % len(MODES)] for i, layer in enumerate(prof.layers)}
    lines = Planner(prof).predict(modes).describe().splitlines()
    header, rows = lines[1], lines[2:]
    assert len(rows) == len(modes)
    mode_at = header.index("mode")
    kept_end = header.index("kept") + len("kept")
    assert header[mode_at - 2 : mode_at] == "  "
    for (name, mode), row in zip(modes.items(), rows, strict=True):
        assert row.startswith(name + "  "), row
        # the mode starts under its header, and the kept bytes end under theirs with a gap before them
        assert row[mode_at:].startswith(mode + "  "), row
        assert row[kept_end] == " " and row[kept_end - 1] != " ", row
        assert row[mode_at + len(mode) : kept_end].startswith("  "), row
