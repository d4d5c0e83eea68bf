"""When a data module's first ``trial.scan_batches`` batches vary, every measured step gets a copy of the largest
(most tensor elements, then most samples): a trial's few steps must include the one that peaks (docs/TUNER.md,
"What a session does"). Lightning has no hook for this: ``train_dataloader`` is replaced on the instance.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class BatchScan:
    scanned: int
    exhaustive: bool  # the loader ended within the scan
    largest_index: int
    largest_samples: int
    largest_elements: int  # inputs and targets together: what activations grow with
    smallest_samples: int
    varies: bool

    def describe(self) -> str:
        where = "the whole epoch" if self.exhaustive else f"the first {self.scanned}; a larger batch may come later"
        if not self.varies:
            return f"every batch scanned has {self.largest_samples} samples ({self.scanned} batches, {where})"
        return (
            f"batches vary ({self.smallest_samples}..{self.largest_samples} samples over {self.scanned} batches, "
            f"{where}): every measured step uses the largest, batch {self.largest_index} "
            f"({self.largest_samples} samples, {self.largest_elements:,} tensor elements)"
        )


def _size(batch: Any) -> tuple[int, int]:
    """``(tensor elements, samples as Lightning counts them)``."""
    import torch
    from lightning.pytorch.utilities.data import extract_batch_size
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    from torch.utils._pytree import tree_flatten

    elements = sum(v.numel() for v in tree_flatten(batch)[0] if isinstance(v, torch.Tensor))
    try:
        return elements, int(extract_batch_size(batch))
    except (MisconfigurationException, RecursionError):  # what Lightning raises for tensor-free or cyclic batches
        return elements, 1


def scan(loader: Iterable[Any], limit: int) -> tuple[BatchScan | None, Any]:
    """The scan of ``loader``'s first ``limit`` batches and its largest batch; ``(None, None)`` when empty."""
    it, end = iter(loader), object()
    sizes: set[tuple[int, int]] = set()
    best, index, largest, smallest, scanned = (0, 0), 0, None, 0, 0
    for scanned, batch in enumerate(itertools.islice(it, limit), 1):
        size = _size(batch)
        smallest = min(smallest, size[1]) if sizes else size[1]
        if not sizes or size > best:  # the first of equals
            best, index, largest = size, scanned - 1, batch
        sizes.add(size)
    if not sizes:
        return None, None
    found = BatchScan(
        scanned=scanned,
        exhaustive=scanned < limit or next(it, end) is end,
        largest_index=index,
        largest_samples=best[1],
        largest_elements=best[0],
        smallest_samples=smallest,
        varies=len(sizes) > 1,
    )
    return found, largest


class LargestBatch:
    """An endless iterable of copies of one batch (a step that edits its batch in place must not change the next)."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def __iter__(self) -> Iterator[Any]:
        import torch
        from torch.utils._pytree import tree_map

        while True:
            yield tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, self.batch)


def serve_largest(datamodule: Any, limit: int) -> Callable[[], dict[str, Any]]:
    """Make ``datamodule.train_dataloader`` serve the largest batch when batches vary; a function giving the
    scan as a result's ``batches`` entry once the trainer has asked for the loader."""
    original = datamodule.train_dataloader
    found: list[BatchScan | None] = [None]

    def train_dataloader() -> Any:
        loader = original()
        found[0], largest = scan(loader, limit)
        return LargestBatch(largest) if found[0] is not None and found[0].varies else loader

    datamodule.train_dataloader = train_dataloader
    return lambda: {} if found[0] is None else {"batches": asdict(found[0])}
