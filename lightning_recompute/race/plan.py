"""How long a race runs and how sure it must be: the recipe's ``race`` section as the race engine reads it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_recompute.race.rule import TIE_MARGIN

__all__ = ["RacePlan"]


@dataclass(frozen=True)
class RacePlan:
    """How long a race runs and how sure it must be (the user's view: `tuner.recipe._schema.RaceSettings`)."""

    steps: int = 2
    """Timed steps per entrant per round (after one settling step)."""
    min_rounds: int = 6
    """Selection rounds before the race may stop early (separated leader, or the budget)."""
    max_rounds: int = 30
    time_s: float = 120.0
    """Seconds of selection rounds at most (the round in progress finishes)."""
    total_s: float | None = None
    """Seconds of rounds at most, selection and estimation together (``None``: no cap); never stops the
    selection before `min_rounds`, and gives estimation `ESTIMATE_SHARE`, at least `MIN_ESTIMATE_ROUNDS`.
    """
    estimate_rounds: int = 16
    """Rounds of the estimation phase (the winner against the references)."""
    confidence: float = 0.95
    """Confidence of the intervals reported, and of "tied"."""
    tie_margin: float = TIE_MARGIN
    stop_confidence: float = 0.99
    """Confidence to stop before `max_rounds` (stricter: it looks after every round)."""
    warmup_steps: int = 2
    """Steps before the first round, neither timed nor metered."""

    # Who races and for how long, in the tuning service.
    leaders: int = 4
    """The fastest fitting trials that race (besides the planner's pick and the baselines)."""
    predicted: int = 2
    """More fitting trials that race because the planner predicts them fastest (its view shares no trial noise)."""
    share: float | None = 0.25
    """The rounds take at most this share of the search's trial time (``None``: only the round and time limits)."""
    min_s: float = 30.0
    """Seconds of rounds the share never cuts below (a share of seconds gives useless intervals)."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RacePlan:
        """The inverse of `to_dict` (unknown keys, from a newer parent, are ignored)."""
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def within(self, search_s: float | None) -> RacePlan:
        """This plan with its `total_s` for a search of ``search_s`` seconds: ``share`` of it, at least ``min_s``."""
        total = max(self.min_s, self.share * search_s) if search_s and self.share is not None else None
        return dataclasses.replace(self, total_s=total)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
