"""The study's setup as its workers share it: who sets it up, whether it is seeded, and what it stored.

One worker profiles the model and seeds a new study (`tuner.session`); every other worker waits for
that and reads what it stored (the profile, the planner's note), so all predict alike. `StudySetup`
is that state, kept in the study's user attributes: the owner and its heartbeat (a dead owner's
setup is taken over), the seeded and abandoned marks, the profile and the planner's note.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import optuna

from tuner._liveness import Owner, dead_reason
from tuner._search.attrs import StudyAttr

__all__ = ["StudySetup"]


class StudySetup:
    """The setup state of ``study`` (an Optuna study), read and written through its user attributes."""

    def __init__(self, study: optuna.Study) -> None:
        self.study = study

    def own(self) -> None:
        """Record this process as the one setting the study up (it created the study, or the worker
        that did died or gave up); a waiting worker takes the setup over once this owner is dead."""
        self.study.set_user_attr(StudyAttr.SETUP_OWNER, Owner.me().to_dict())
        self.study.set_user_attr(StudyAttr.SETUP_HEARTBEAT, time.time())

    def beat(self) -> None:
        """The setting-up session's heartbeat."""
        self.study.set_user_attr(StudyAttr.SETUP_HEARTBEAT, time.time())

    def wait_seeded(self, timeout_s: float, poll_s: float = 0.5, *, grace_s: float = 60.0) -> bool:
        """Wait for the process that created the study to finish setting it up; whether it did.

        The creator profiles the model and seeds the study right after creating it; another worker
        started at the same moment waits for that rather than doing it twice. It stops waiting
        when the creator gave up (it was interrupted while setting up), when the creator is dead
        (`owner_dead`; at once on the same host, after ``grace_s`` without a heartbeat elsewhere),
        or after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            attrs = self.study.user_attrs
            if attrs.get(StudyAttr.SEEDED):
                return True
            if attrs.get(StudyAttr.ABANDONED) or time.monotonic() >= deadline:
                return False
            if self.owner_dead(grace_s) is not None:
                return False
            time.sleep(poll_s)

    def owner_dead(self, grace_s: float) -> str | None:
        """Why the session setting the study up is dead, or ``None`` (alive, done, or not recorded)."""
        attrs = self.study.user_attrs
        if attrs.get(StudyAttr.SEEDED):
            return None
        owner = Owner.from_dict(attrs.get(StudyAttr.SETUP_OWNER))
        if owner is None:
            return None  # an older version's study, or the creator has not recorded itself yet
        beat = attrs.get(StudyAttr.SETUP_HEARTBEAT)
        return dead_reason(owner, float(beat) if beat is not None else None, grace=grace_s)

    @property
    def seeded(self) -> bool:
        """Whether the session that set the study up has seeded it."""
        return bool(self.study.user_attrs.get(StudyAttr.SEEDED))

    def mark_seeded(self) -> None:
        """Say that the study is seeded: waiting workers go on, and no session seeds it again."""
        self.study.set_user_attr(StudyAttr.SEEDED, True)

    def abandon(self) -> None:
        """Say that this process stopped setting up the study, so no other worker waits for it."""
        if not self.study.user_attrs.get(StudyAttr.SEEDED):
            self.study.set_user_attr(StudyAttr.ABANDONED, True)

    def profile(self) -> dict[str, Any] | None:
        """The model's profile as the setting-up session stored it (`Profile.to_dict`), if any."""
        return self.study.user_attrs.get(StudyAttr.PROFILE)

    def store_profile(self, profile: Mapping[str, Any]) -> None:
        """Keep the model's profile in the study, so every session of it predicts with the same figures."""
        self.study.set_user_attr(StudyAttr.PROFILE, dict(profile))

    def planner_note(self) -> str | None:
        """Why the setting-up session had no planner, or what its planner could not do."""
        note = self.study.user_attrs.get(StudyAttr.PLANNER_NOTE)
        return None if note is None else str(note)

    def store_planner_note(self, note: str) -> None:
        """Record `planner_note` for the sessions that join or resume the study."""
        self.study.set_user_attr(StudyAttr.PLANNER_NOTE, note)
