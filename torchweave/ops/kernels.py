"""Local computations for pieces that are not the whole op on a slice.

Generated per-rank code calls these by their import path, so each is a plain,
differentiable function of torch ops.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def vocab_embedding(weight: torch.Tensor, indices: torch.Tensor, offset: int) -> torch.Tensor:
    """Look up ``indices`` in rows ``[offset, offset + len(weight))`` of a split table.

    Rows outside the shard give zeros, so the pieces of all shards sum to the
    full lookup (a partial sum over the vocabulary).
    """
    local = indices - offset
    inside = (local >= 0) & (local < weight.shape[0])
    out = F.embedding(torch.where(inside, local, torch.zeros_like(local)), weight)
    return out * inside.unsqueeze(-1).to(out.dtype)


def vocab_local(args: tuple[Any, ...], kwargs: dict[str, Any], split: Any, index: int,
                sizes: dict[str, int]):
    """Piece rewrite of ``aten.embedding`` when the vocabulary is split."""
    if split.dim != "v":
        return None
    weight, indices = args[0], args[1]
    offset = index * (sizes["v"] // split.parts)
    return vocab_embedding, (weight, indices, offset), {}


def vocab_gather(x: torch.Tensor, dim: int, index: torch.Tensor, offset: int) -> torch.Tensor:
    """``x.gather(dim, index)`` on a shard holding entries ``[offset, offset + len)``
    of ``dim``; indices outside the shard give zeros (a partial sum)."""
    local = index - offset
    inside = (local >= 0) & (local < x.shape[dim])
    out = x.gather(dim, torch.where(inside, local, torch.zeros_like(local)))
    return out * inside.to(out.dtype)


def gather_local(args: tuple[Any, ...], kwargs: dict[str, Any], split: Any, index: int,
                 sizes: dict[str, int]):
    """Piece rewrite of ``aten.gather`` when the gathered dim is split."""
    if split.dim != "c":
        return None
    x, dim, idx = args[0], args[1], args[2]
    return vocab_gather, (x, dim, idx, index * (sizes["c"] // split.parts)), {}
