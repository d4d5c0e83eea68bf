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
    """How long a race runs and how sure it must be (see `tuner.recipe._schema.RaceSettings` for the user's view)."""

    steps: int = 2
    """Timed steps per entrant per round (after one settling step)."""
    min_rounds: int = 6
    """Selection rounds before the race may stop early: on a separated leader, or on the race budget
    (`total_s`)."""
    max_rounds: int = 30
    """Selection rounds at most."""
    time_s: float = 120.0
    """Seconds of selection rounds at most (the round in progress finishes)."""
    total_s: float | None = None
    """Seconds of rounds at most, selection and estimation together (``None``: no such cap): the selection
    stops when what it spent and what the estimation rounds will take, at the step times seen so far,
    reach it, but not before `min_rounds`. The estimation then runs at most
    `lightning_recompute.race.schedule.ESTIMATE_SHARE` of it in rounds, never fewer than
    `lightning_recompute.race.schedule.MIN_ESTIMATE_ROUNDS` (they give the "vs" figures)."""
    estimate_rounds: int = 16
    """Rounds of the estimation phase (the winner against the references)."""
    confidence: float = 0.95
    """Confidence of the intervals reported, and of "tied" (not separated at this level)."""
    tie_margin: float = TIE_MARGIN
    """How far behind the leader an unseparated entrant may be and still tie (`race.rule.Standing`)."""
    stop_confidence: float = 0.99
    """Confidence the selection needs to stop before `max_rounds` (stricter: it looks after every round)."""
    warmup_steps: int = 2
    """Steps before the first round (lazy initialisation, optimizer state), neither timed nor metered."""

    # Who races and how long, for the tuning service (AutoRecompute races what it profiled).
    leaders: int = 4
    """The fastest fitting trials that race (besides the planner's pick and the baselines)."""
    predicted: int = 2
    """More fitting trials that race because the planner predicts them fastest: one trial under load can
    rank the fastest policy below the leaders, and the planner's view does not share that noise."""
    share: float | None = 0.25
    """The rounds take at most this share of the search's trial time (``total_s``), so a race costs a fixed
    share of the search; ``None``: only ``time_s`` and ``max_rounds`` bound it."""
    min_s: float = 30.0
    """Seconds of rounds the share never cuts below: a search of a dozen forked trials takes seconds, and
    its share alone leaves intervals too wide to act on."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RacePlan:
        """The inverse of `to_dict` (keys it does not know are ignored: a newer parent's plan)."""
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def within(self, search_s: float | None) -> RacePlan:
        """This plan with its budget (`total_s`) for a search whose trials took ``search_s`` seconds:
        ``share`` of it, never under ``min_s`` (``None``: no search time, or no share)."""
        total = max(self.min_s, self.share * search_s) if search_s and self.share is not None else None
        return dataclasses.replace(self, total_s=total)

    def to_dict(self) -> dict[str, Any]:
        """Plain types (JSON-ready)."""
        return dataclasses.asdict(self)
