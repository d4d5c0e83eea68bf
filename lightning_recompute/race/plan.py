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

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RacePlan:
        """The inverse of `to_dict` (keys it does not know are ignored: a newer parent's plan)."""
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def to_dict(self) -> dict[str, Any]:
        """Plain types (JSON-ready)."""
        return dataclasses.asdict(self)
