"""`DecisionKind`, where earlier code imported it from; the decision runs are `tuner._tracking.registry`'s."""

from tuner._tracking.registry import DecisionKind

__all__ = ["DecisionKind"]
