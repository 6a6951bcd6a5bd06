"""A small model trained with recycling, in the manner of AlphaFold 2.

Each residue of a sequence gets a representation from its type; the blocks
refine it; a structure head predicts 3-D coordinates, and the loss is their
mean squared error against the targets. Two tensors come back as inputs of
the next pass: the final normalized representation (``prev_single``) and
the predicted coordinates (``prev_coords``). On one device a training step is

.. code-block:: python

    prev = zeros
    with torch.no_grad():                      # passes - 1 recycling passes
        for _ in range(passes - 1):
            prev = model.recycled(*batch, *prev)
    loss = model(*batch, *prev)                # the pass with gradients

The class attribute :attr:`Recycler.recycle` names, for each recycled input,
the module whose output feeds it; torchweave's multi-forward plans read it
(``"1f1b:recycle=3"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from torchweave.models.gpt import Block, GPTConfig


@dataclass(frozen=True, kw_only=True)
class RecyclerConfig:
    """Hyper-parameters of :class:`Recycler`."""

    n_types: int = 20
    """Residue types."""
    length: int = 16
    """Residues per sequence."""
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 32


class Recycler(nn.Module):
    """``forward(aatype, coords, prev_single, prev_coords)`` → coordinate loss."""

    recycle = {"prev_single": "norm", "prev_coords": "structure"}
    """Recycled input → the module whose output it takes on the next pass."""

    def __init__(self, cfg: RecyclerConfig) -> None:
        super().__init__()
        block = GPTConfig(vocab_size=cfg.n_types, block_size=cfg.length, n_layer=cfg.n_layer,
                          n_head=cfg.n_head, d_model=cfg.d_model)
        self.embed = nn.Embedding(cfg.n_types, cfg.d_model)
        self.recycle_norm = nn.LayerNorm(cfg.d_model)
        self.recycle_single = nn.Linear(cfg.d_model, cfg.d_model)
        self.recycle_coords = nn.Linear(3, cfg.d_model)
        self.blocks = nn.ModuleList([Block(block) for _ in range(cfg.n_layer)])
        self.norm = nn.LayerNorm(cfg.d_model)
        self.structure = nn.Linear(cfg.d_model, 3)

    def _trunk(self, aatype: torch.Tensor, prev_single: torch.Tensor,
               prev_coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(aatype) + self.recycle_single(self.recycle_norm(prev_single)) \
            + self.recycle_coords(prev_coords)
        for block in self.blocks:
            h = block(h)
        single = self.norm(h)
        return single, self.structure(single)

    def forward(self, aatype: torch.Tensor, coords: torch.Tensor, prev_single: torch.Tensor,
                prev_coords: torch.Tensor) -> torch.Tensor:
        _, pred = self._trunk(aatype, prev_single, prev_coords)
        return ((pred - coords) ** 2).mean()

    def recycled(self, aatype: torch.Tensor, coords: torch.Tensor, prev_single: torch.Tensor,
                 prev_coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass's recycled outputs, in the order of :attr:`recycle`."""
        return self._trunk(aatype, prev_single, prev_coords)


def example(cfg: RecyclerConfig, batch: int) -> tuple[Recycler, tuple[torch.Tensor, ...]]:
    """The model and a seeded batch, recycled inputs zero."""
    g = torch.Generator().manual_seed(1234)
    aatype = torch.randint(0, cfg.n_types, (batch, cfg.length), generator=g)
    coords = torch.randn(batch, cfg.length, 3, generator=g)
    return Recycler(cfg), (aatype, coords, torch.zeros(batch, cfg.length, cfg.d_model),
                           torch.zeros(batch, cfg.length, 3))
