"""Models whose layers change module state in their forward, the cases recomputation must not run twice.

Each `StatefulNet` block updates buffers while training: BatchNorm's running statistics and counter,
spectral norm's power-iteration vectors (``_u``, ``_v``), or a user's step counter (reassigned) and EMA
(updated in place). Importable by child processes (multi-rank scripts) as ``tests.plugin.stateful_models``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

KINDS = ("batchnorm", "spectral", "counter")


class BatchNormBlock(nn.Module):
    """A ResNet basic block: conv, BatchNorm, ReLU, conv, BatchNorm, the residual."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.drop(self.bn2(self.conv2(h))))


class SpectralBlock(nn.Module):
    """A 1x1 convolution as a spectral-normalized Linear over channels (a GAN discriminator's habit)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.proj = nn.utils.parametrizations.spectral_norm(nn.Linear(c, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.leaky_relu(self.proj(x.movedim(1, -1)).movedim(-1, 1), 0.2)


class CounterBlock(nn.Module):
    """Buffers a user updates in forward: a step counter reassigned, an EMA of the inputs updated in place."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("input_mean", torch.zeros(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps = self.steps + 1
            self.input_mean.mul_(0.9).add_(x.detach().mean((0, 2, 3)), alpha=0.1)
        # The state feeds the output: a replay that saw the updated state would compute something else.
        scale = 1.0 + 1.0 / (1.0 + self.steps.float())
        return torch.tanh(self.conv(x - self.input_mean[:, None, None]) * scale)


BLOCKS: dict[str, type[nn.Module]] = {"batchnorm": BatchNormBlock, "spectral": SpectralBlock, "counter": CounterBlock}


class StatefulNet(L.LightningModule):
    """Stem, three blocks of one kind (``blocks.0`` .. ``blocks.2``), pooled linear head; SGD."""

    def __init__(self, kind: str = "batchnorm", channels: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*(BLOCKS[kind](channels) for _ in range(3)))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def loss(self, batch: Any) -> torch.Tensor:
        """The training loss of ``(images, labels)``, as the reference GPT's ``loss`` (what benches call)."""
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def images(n: int = 24, batch_size: int = 4, size: int = 8, classes: int = 5, seed: int = 0) -> DataLoader:
    """Random images and labels, in a fixed order."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, size, size, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Everything a trained model is: every ``state_dict`` entry, and the eval-mode output on fixed images."""
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    was = model.training
    model.eval()
    with torch.no_grad():
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
        out["eval output"] = model(x)
    model.train(was)
    return out


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose tensors are not bitwise equal (a key missing on one side counts)."""
    return [k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k])]


class Images(L.LightningDataModule):
    """`images` as a data module (what a recipe names)."""

    def __init__(self, batch_size: int = 4, num_batches: int = 6, size: int = 8) -> None:
        super().__init__()
        self.batch_size, self.num_batches, self.size = batch_size, num_batches, size

    def train_dataloader(self) -> DataLoader:
        return images(n=self.batch_size * self.num_batches, batch_size=self.batch_size, size=self.size)
