"""Run one piece of a split op, and put pieces back together.

This is the meaning of an annotation, made executable: splitting a spatial dim
cuts every tensor that has it and concatenates the outputs; splitting a
reduction cuts the inputs and sums (or averages) the outputs. The registry's
self-check and the runtime both use these functions.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from torchweave.ops.bind import Bound, Split
from torchweave.ops.registry import OpSpec


def piece_shape(bound: Bound, tensor_index: int, split: Split, *, output: bool) -> list[int]:
    """Local shape of one input (or output) tensor under ``split``."""
    specs = bound.annotation.outputs if output else bound.annotation.inputs
    spec = specs[tensor_index]
    shape = []
    for axis in spec.axes:
        size = 1
        for d in axis.dims:
            size *= bound.sizes[d.name] // (split.parts if d.name == split.dim else 1)
        shape.append(size)
    return shape


def slice_tensor(t: torch.Tensor, bound: Bound, spec_index: int, split: Split, index: int,
                 *, output: bool = False) -> torch.Tensor:
    """The ``index``-th piece of a tensor (whole if it lacks the split dim)."""
    specs = bound.annotation.outputs if output else bound.annotation.inputs
    spec = specs[spec_index]
    if spec.opaque:
        return t
    axis = bound.axis_of(spec, split.dim)
    if axis is None:
        return t
    step = t.shape[axis] // split.parts
    return t.narrow(axis, index * step, step)


def piece_call(
    spec: OpSpec, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
    bound: Bound, split: Split, index: int,
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """The callable and arguments that compute piece ``index`` of a call."""
    leaves, tree = pytree.tree_flatten((args, kwargs))
    k = 0
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            leaves[i] = slice_tensor(leaf, bound, k, split, index)
            k += 1
    args, kwargs = pytree.tree_unflatten(leaves, tree)
    if spec.shape_arg is not None:
        pos, name = spec.shape_arg
        local = piece_shape(bound, 0, split, output=True)
        if pos < len(args):
            args = args[:pos] + (local,) + args[pos + 1 :]
        else:
            kwargs = {**kwargs, name: local}
    if spec.local is not None:
        custom = spec.local(args, kwargs, split, index, bound.sizes)
        if custom is not None:
            return custom
    return fn, args, kwargs


def combine(bound: Bound, split: Split, pieces: list[list[torch.Tensor]], partial: str,
            full: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Join the pieces' outputs as the annotation says; None where they disagree.

    ``full`` is used only for outputs that lack the split dim and are not
    partial: each piece must then equal the whole, and a piece is returned.
    """
    out: list[torch.Tensor | None] = []
    for j, spec in enumerate(bound.annotation.outputs):
        parts = [p[j] for p in pieces]
        axis = None if spec.opaque else bound.axis_of(spec, split.dim)
        if axis is not None:
            out.append(torch.cat(parts, dim=axis))
        elif split.kind == "reduce" and not spec.opaque:
            stacked = torch.stack([p.to(torch.float64) for p in parts])
            total = torch.logsumexp(stacked, 0) if partial == "lse" else stacked.sum(0)
            if partial == "avg":
                total = total / split.parts
            out.append(total.to(parts[0].dtype))
        else:
            same = all(_close(p, parts[0]) for p in parts)
            out.append(parts[0] if same else None)
    del full
    return out


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.dtype.is_floating_point:
        return bool(torch.equal(a, b))
    scale = max(float(b.detach().abs().max()) if b.numel() else 0.0, 1.0)
    return bool(torch.allclose(a, b, rtol=rtol, atol=atol * scale, equal_nan=True))
