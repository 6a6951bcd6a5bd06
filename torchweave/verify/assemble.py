"""Whole tensors from every rank's pieces, one assembly per copy, and the worst difference
over them (:func:`torchweave.verify.verify_many` compares each with one device)."""

from __future__ import annotations

import math
from typing import Any

import torch

from torchweave.ir.graph import Graph, join_parts


def _assemble(pieces: list[dict[str, tuple[Any, torch.Tensor | None]]],
              graph: Graph) -> list[dict[str, torch.Tensor]]:
    """Whole tensors by the model's names, from every rank's pieces: one assembly per copy.

    Several ranks may hold one piece (data-parallel replicas; a pipeline stage's copy of a
    tied embedding). Assembly ``k`` takes the ``k``-th holder of each piece (the last, where
    a piece has fewer), so a copy that drifted from the others is judged, not hidden."""
    shapes = {p.target: p.meta.shape for p in graph.params()}
    holders: dict[tuple[str, Any], list[torch.Tensor]] = {}
    for rank_pieces in pieces:
        for path, (box, t) in rank_pieces.items():
            if t is not None and path in shapes:
                holders.setdefault((path, tuple(map(tuple, box))), []).append(t)
    out: list[dict[str, torch.Tensor]] = []
    for k in range(max((len(ts) for ts in holders.values()), default=1)):
        whole: dict[str, torch.Tensor] = {}
        for (path, box), ts in holders.items():
            t = ts[min(k, len(ts) - 1)]
            full = whole.setdefault(path, torch.zeros(shapes[path], dtype=t.dtype))
            full[tuple(slice(a, b) for a, b in box)] = t.to(full.dtype)
        out.append(join_parts(graph, whole))
    return out


def _worst(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per tensor, the largest difference over the assemblies of :func:`_assemble`."""
    out: dict[str, float] = {}
    for diffs in runs:
        for path, d in diffs.items():
            prev = out.get(path, d)
            out[path] = d if math.isnan(d) or d > prev else prev  # a NaN is never hidden
    return out
