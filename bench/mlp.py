"""The residual MLP stack the benchmarks share (tensor parallelism, pipelines), and its stage cuts."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """``x + fc2(gelu(fc1(x)))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class ResidualMLP(nn.Module):
    """``blocks`` residual MLP blocks; ``forward(x)`` returns the loss ``out.pow(2).mean()``."""

    def __init__(self, dim: int, hidden: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def block_cuts(graph, blocks: int, stages: int) -> list[int]:
    """Node indices that cut a captured stack of ``blocks`` blocks into ``stages`` equal stages."""
    starts = [next(i for i, n in enumerate(graph.nodes) if n.module.startswith(f"blocks.{b}"))
              for b in range(blocks)]
    return [starts[s * (blocks // stages)] for s in range(1, stages)]
