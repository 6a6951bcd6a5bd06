"""Merged single-device weights as safetensors, loadable with ``load_state_dict(strict=True)``."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph
from torchweave.runtime.statedict import moved_box

Pieces = Mapping[str, tuple[Any, torch.Tensor]]
"""Path → (box, local piece): what :meth:`RankModule.state_pieces` returns."""


class ExportError(TorchweaveError):
    """Pieces that do not make up the full tensors."""


def model_layout(graph: Graph, state_keys: Iterable[str]) -> tuple[dict[str, tuple[int, ...]],
                                                                   dict[str, tuple[str, ...]]]:
    """(full shapes, aliases) of the parameters and buffers a state dict names.

    ``state_keys`` is ``model.state_dict().keys()``: lifted constants and
    non-persistent buffers are left out, and every tied weight's other paths
    are listed as aliases of the path the pieces carry.
    """
    keys = set(state_keys)
    shapes: dict[str, tuple[int, ...]] = {}
    aliases: dict[str, tuple[str, ...]] = {}
    for path, dim, start, v in ((*v.part, v) for v in graph.params() if v.part is not None):
        if path in keys:  # a module tensor the graph holds as parts: its whole shape
            shape = list(shapes.get(path, v.meta.shape))
            shape[dim] = max(shape[dim] if path in shapes else 0, start + v.meta.shape[dim])
            shapes[path] = tuple(shape)
    for v in graph.params() + graph.buffers():
        names = [n for n in (v.target, *v.aliases) if n in keys]
        if not names:
            continue
        shapes[v.target] = tuple(v.meta.shape)
        others = tuple(n for n in v.aliases if n in keys and n != v.target)
        if others:
            aliases[v.target] = others
    return shapes, aliases


def merge_pieces(pieces_by_rank: Sequence[Pieces], shapes: Mapping[str, Sequence[int]],
                 parts: Mapping[str, tuple[str, int, int]] | None = None) -> dict[str, torch.Tensor]:
    """Full tensors of ``shapes`` assembled from every rank's pieces, checked for full cover.

    ``parts``: the path of a piece that is a slice of a module tensor → ``(module path, dim,
    start)`` (:attr:`ParamSlot.part <torchweave.lower.program.ParamSlot.part>`): its piece
    lands there."""
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for pieces in pieces_by_rank:
        for path, (box, t) in pieces.items():
            if parts and path in parts:
                path, dim, start = parts[path]
                box = moved_box(box, dim, start)
            if path not in shapes:
                continue  # a lifted constant, or a buffer outside the state dict
            shape = tuple(shapes[path])
            if path not in out:
                out[path] = torch.zeros(shape, dtype=t.dtype)
                covered[path] = torch.zeros(shape, dtype=torch.bool)
            index = tuple(slice(a, b) for a, b in box)
            if tuple(b - a for a, b in box) != tuple(t.shape):
                raise ExportError(Problem(obj=f"tensor {path}", value=f"piece {tuple(t.shape)}",
                                          rule=f"the piece fills its box {list(box)}"))
            out[path][index] = t.detach().to("cpu", out[path].dtype)
            covered[path][index] = True
    problems = []
    for path in shapes:
        if path not in out:
            problems.append(Problem(obj=f"tensor {path}", value="no piece on any rank",
                                    rule="every exported tensor is held by some rank"))
        elif not bool(covered[path].all()):
            problems.append(Problem(obj=f"tensor {path}",
                                    value=f"{int((~covered[path]).sum())} elements not covered",
                                    rule="the ranks' boxes cover the full tensor"))
    if problems:
        raise ExportError(problems, header="cannot merge the pieces")
    return out


def export_safetensors(pieces_by_rank: Sequence[Pieces], shapes: Mapping[str, Sequence[int]],
                       path: str | os.PathLike, *,
                       aliases: Mapping[str, Iterable[str]] | None = None,
                       parts: Mapping[str, tuple[str, int, int]] | None = None) -> dict[str, torch.Tensor]:
    """Merge every rank's pieces into full tensors and write them to ``path`` (safetensors).

    ``shapes``: path → full shape of each tensor to write (see :func:`model_layout`).
    ``parts``: as :func:`merge_pieces` takes them.
    ``aliases``: path → other state-dict names of the same tensor (tied
    weights); each is written as its own copy, since safetensors stores no
    shared tensors, so that ``load_state_dict(strict=True)`` finds every key.
    Returns what was written.
    """
    from safetensors.torch import save_file

    full = merge_pieces(pieces_by_rank, shapes, parts)
    for src, others in (aliases or {}).items():
        for name in others:
            full[name] = full[src].clone()
    full = {k: v.contiguous() for k, v in full.items()}
    tmp = f"{os.fspath(path)}.tmp"
    save_file(full, tmp, metadata={"format": "pt", "producer": "torchweave"})
    os.replace(tmp, path)
    return full


__all__ = ["ExportError", "export_safetensors", "merge_pieces", "model_layout"]
