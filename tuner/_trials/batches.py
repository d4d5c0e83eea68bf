"""The largest batch a data module yields, found by scanning its first batches and served to every measured step.

With batches that vary (dynamic padding, a last partial batch), a trial's few steps say little about the
step that peaks. So the worker scans the loader's first ``trial.scan_batches`` batches before the fit:
when they are all the same size the loader reaches Lightning unchanged; when they vary, every step gets a
copy of the largest (most tensor elements, then most samples). docs/TUNER.md, "What a session does".
Replacing ``train_dataloader`` on the instance is the narrowest place: Lightning has no hook for this.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["BatchScan", "LargestBatch", "scan", "serve_largest"]


@dataclass(frozen=True)
class BatchScan:
    """What a scan of a data loader's first batches found."""

    scanned: int
    """Batches scanned."""
    exhaustive: bool
    """The loader ended within the scan: every batch of an epoch was seen."""
    largest_index: int
    """0-based index of the largest batch (most tensor elements, then most samples; the first of equals)."""
    largest_samples: int
    """Samples in the largest batch."""
    largest_elements: int
    """Tensor elements in the largest batch (inputs and targets together): what activations grow with."""
    smallest_samples: int
    """Samples in the smallest batch scanned."""
    varies: bool
    """Batches differ in samples or tensor elements."""

    def to_dict(self) -> dict[str, Any]:
        """Plain types (JSON-ready)."""
        return asdict(self)

    def describe(self) -> str:
        """One line for a person: what was scanned and which batch the measurements use."""
        where = "the whole epoch" if self.exhaustive else f"the first {self.scanned}; a larger batch may come later"
        if not self.varies:
            return f"every batch scanned has {self.largest_samples} samples ({self.scanned} batches, {where})"
        return (
            f"batches vary ({self.smallest_samples}..{self.largest_samples} samples over {self.scanned} batches, "
            f"{where}): every measured step uses the largest, batch {self.largest_index} "
            f"({self.largest_samples} samples, {self.largest_elements:,} tensor elements)"
        )


def _size(batch: Any) -> tuple[int, int]:
    """``(tensor elements, samples)`` of a batch (samples as Lightning counts them; 1 without tensors)."""
    import torch
    from lightning.pytorch.utilities.data import extract_batch_size
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    from torch.utils._pytree import tree_flatten

    elements = sum(v.numel() for v in tree_flatten(batch)[0] if isinstance(v, torch.Tensor))
    try:
        samples = int(extract_batch_size(batch))
    except (MisconfigurationException, RecursionError):  # what Lightning raises for tensor-free or cyclic batches
        samples = 1
    return elements, samples


def scan(loader: Iterable[Any], limit: int) -> tuple[BatchScan | None, Any]:
    """The scan of ``loader``'s first ``limit`` batches, and its largest batch; ``(None, None)`` when empty."""
    if limit < 1:
        raise ValueError(f"scan limit must be at least 1, got {limit}")
    it = iter(loader)
    best: tuple[int, int] | None = None
    largest, index, scanned, smallest, sizes = None, 0, 0, 0, set()
    for i, batch in enumerate(itertools.islice(it, limit)):
        size = _size(batch)
        sizes.add(size)
        smallest = size[1] if scanned == 0 else min(smallest, size[1])
        scanned += 1
        if best is None or size > best:
            best, largest, index = size, batch, i
    if best is None:
        return None, None
    exhaustive = scanned < limit or next(it, _END) is _END
    found = BatchScan(
        scanned=scanned,
        exhaustive=exhaustive,
        largest_index=index,
        largest_samples=best[1],
        largest_elements=best[0],
        smallest_samples=smallest,
        varies=len(sizes) > 1,
    )
    return found, largest


_END = object()


class LargestBatch:
    """An endless iterable of copies of one batch (a step that edits its batch in place must not change the next)."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def __iter__(self) -> Iterator[Any]:
        import torch
        from torch.utils._pytree import tree_map

        while True:
            yield tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, self.batch)


def serve_largest(datamodule: Any, limit: int) -> Callable[[], BatchScan | None]:
    """Make ``datamodule.train_dataloader`` scan its loader and, when batches vary, serve the largest batch.

    Returns a function giving the scan once the trainer has asked for the loader (``None`` before, or if empty).
    """
    original = datamodule.train_dataloader
    found: list[BatchScan | None] = [None]

    def train_dataloader() -> Any:
        loader = original()
        result, largest = scan(loader, limit)
        found[0] = result
        if result is None or not result.varies:
            return loader  # a fresh iterator of the same loader: the scan consumed nothing Lightning sees
        return LargestBatch(largest)

    datamodule.train_dataloader = train_dataloader
    return lambda: found[0]
