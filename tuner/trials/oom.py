"""Recognising an out-of-memory failure, on both sides of the trial protocol.

The child classifies the exception it caught (`is_oom_error`); the parent classifies what a
child that died left in its output (`OOM_MARKERS`).
"""

from __future__ import annotations

__all__ = ["OOM_MARKERS", "is_oom_error"]

OOM_MARKERS = ("CUDA out of memory", "DefaultCPUAllocator: can't allocate memory", "OutOfMemoryError")
"""Text that identifies an out-of-memory failure in an error message or a traceback."""


def is_oom_error(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) is an out-of-memory error."""
    import torch

    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, torch.OutOfMemoryError):
            return True
        if isinstance(cur, RuntimeError) and any(m in str(cur) for m in OOM_MARKERS[:2]):
            return True
        cur = cur.__cause__ or cur.__context__
    return False
