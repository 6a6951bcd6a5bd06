"""Models and datasets the trainer tests name by import path (``tests.dist.train_helpers:...``)."""

from __future__ import annotations

import time

import torch
import torch.nn as nn


class Regression(nn.Module):
    """A two-layer MLP with a mean-squared-error loss: ``forward(x, y) -> loss``."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.fc2 = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.fc2(torch.relu(self.fc1(x))).squeeze(-1) - y).pow(2).mean()


def regression(width: int = 16) -> nn.Module:
    return Regression(width)


class PoisonedData:
    """Random regression samples; the samples at ``nan_at`` hold NaN inputs."""

    def __init__(self, size: int = 64, nan_at: list[int] = ()) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(size, 8, generator=g)
        self.y = torch.randn(size, generator=g)
        self.x[list(nan_at)] = float("nan")

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class SlowTokens:
    """Seeded token windows that take ``delay_s`` each to read (to leave time to kill a rank)."""

    def __init__(self, seq_len: int = 16, vocab_size: int = 64, size: int = 256,
                 delay_s: float = 0.0) -> None:
        g = torch.Generator().manual_seed(3)
        self.data = torch.randint(0, vocab_size, (size, seq_len + 1), generator=g)
        self.vocab_size, self.delay_s = vocab_size, delay_s

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.data[i, :-1], self.data[i, 1:]
