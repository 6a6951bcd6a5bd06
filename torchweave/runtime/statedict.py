"""A parallel module's state under the original model's names: whole, or as DCP shards.

Every rank holds pieces (boxes) of some parameters; several ranks may hold the
same piece. :class:`StateLayout`, built once from every rank's program, names
for each parameter its distinct pieces and the first rank holding each (its
*owner*). A whole tensor is rebuilt by one sum over the world in which only
owners write (so it is exact); a sharded entry is a ``ShardedTensor`` whose
shards are the owned pieces, which ``torch.distributed.checkpoint`` writes
and reads, and can load into a plain model's whole ``state_dict()``.

(``ShardedTensor`` rather than ``DTensor``: a plan's pieces need not be an even
split over a device mesh, and ``ShardedTensor`` takes any set of boxes. Its
deprecation warning comes from PyTorch.)
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.distributed as dist

from torchweave.errors import Problem, TorchweaveError
from torchweave.lower.program import Program

Box = tuple[tuple[int, int], ...]


@dataclass
class StateLayout:
    """Where each parameter's pieces live, and the model's own ``state_dict`` names."""

    pieces: dict[str, list[tuple[Box, int]]]
    """Path → each distinct piece and the first rank holding it."""
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    keys: dict[str, str]
    """The model's ``state_dict`` key → the path the ranks hold (tied weights: one path)."""
    fixed: dict[str, torch.Tensor] = field(default_factory=dict)
    """Keys no rank holds (state the graph never reads): their value as given."""
    parts: dict[str, list[tuple[str, int, int]]] = field(default_factory=dict)
    """A module tensor the ranks hold as parts (a fused projection split by capture) → each
    part's ``(path, dim, start)``. Its ``pieces`` are the parts' pieces, moved to its own
    coordinates."""


def state_layout(model: torch.nn.Module, programs: Iterable[Program],
                 state: dict[str, torch.Tensor]) -> StateLayout:
    held: dict[str, dict[Box, int]] = {}
    parts: dict[str, dict[str, tuple[str, int, int]]] = {}
    for prog in programs:
        for slot in prog.params:
            box = tuple((int(a), int(b)) for a, b in slot.box)
            held.setdefault(slot.path, {}).setdefault(box, prog.rank)
            if slot.part is not None:
                parts.setdefault(slot.part[0], {})[slot.path] = (slot.path, *slot.part[1:])
    for whole, of in parts.items():  # a joined tensor's pieces: its parts', moved
        held[whole] = {moved_box(box, dim, start): owner for path, dim, start in of.values()
                       for box, owner in held[path].items()}
    own = model.state_dict(keep_vars=True)
    names: dict[int, list[str]] = {}
    for k, v in own.items():
        names.setdefault(id(v), []).append(k)
    keys, fixed = {}, {}
    for k, v in own.items():
        path = k if k in held else next((a for a in names[id(v)] if a in held), None)
        if path is None:
            fixed[k] = v.detach()  # the model's own tensor: its value when the state is read
        else:
            keys[k] = path
    paths = set(keys.values())
    for p in paths:  # the distinct pieces tile the tensor: a whole one is their exact sum
        volume = sum(math.prod(b - a for a, b in box) for box in held[p])
        if volume != state[p].numel():
            raise TorchweaveError(Problem(
                obj=f"parameter {p}", value=f"pieces of {volume} elements in all",
                rule=f"the ranks' distinct pieces tile its {state[p].numel()} elements once",
                fix="report this plan: its pieces overlap or leave a gap"))
    joined = {w: sorted(of.values(), key=lambda x: x[2]) for w, of in parts.items() if w in paths}
    paths |= {path for of in joined.values() for path, _, _ in of}
    return StateLayout(
        pieces={p: sorted(held[p].items()) for p in paths},
        shapes={p: tuple(state[p].shape) for p in paths},
        dtypes={p: state[p].dtype for p in paths}, keys=keys, fixed=fixed, parts=joined)


def moved_box(box: Box, dim: int, start: int) -> Box:
    """A box of a part, in the coordinates of the tensor it is a slice of."""
    return tuple((a + start, b + start) if i == dim else (a, b) for i, (a, b) in enumerate(box))


def _mine(layout: StateLayout, path: str, pieces: dict[str, torch.Tensor], rank: int) -> dict[Box, torch.Tensor]:
    """The pieces of ``path`` that ``rank`` owns, by box (a joined tensor's: its parts')."""
    if path in layout.parts:
        return {moved_box(box, dim, start): pieces[part] for part, dim, start in layout.parts[path]
                for box, owner in layout.pieces[part] if owner == rank}
    return {box: pieces[path] for box, owner in layout.pieces[path] if owner == rank}


def _box(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[tuple(slice(a, b) for a, b in box)]


def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """A dtype the world sum takes exactly (every backend sums float32, float64 and int64)."""
    if dtype in (torch.float32, torch.float64, torch.int64):
        return dtype
    return torch.float64 if dtype.is_floating_point or dtype == torch.bool else torch.int64


SUM_CHUNK = 256 * 2**20
"""Bytes summed over the world in one all-reduce when a whole state is gathered."""


def _whole(layout: StateLayout, path: str, mine: dict[Box, torch.Tensor], device: Any) -> torch.Tensor:
    """The whole tensor from the owned pieces of every rank (a sum over the world)."""
    return _wholes(layout, {path: mine}, device)[path]


def _wholes(layout: StateLayout, mine: dict[str, dict[Box, torch.Tensor]],
            device: Any) -> dict[str, torch.Tensor]:
    """Each path's whole tensor from the owned pieces of every rank: one flat sum over the
    world per :data:`SUM_CHUNK` bytes of a summing dtype, not one per tensor (``mine``'s order
    is every rank's, so the chunks are too)."""
    flat: dict[torch.dtype, list[list[str]]] = {}
    filled: dict[torch.dtype, int] = {}
    for path in mine:  # runs of paths, each at most SUM_CHUNK bytes (or one larger tensor)
        dtype = _sum_dtype(layout.dtypes[path])
        nbytes = math.prod(layout.shapes[path]) * dtype.itemsize
        runs = flat.setdefault(dtype, [[]])
        if runs[-1] and filled.get(dtype, 0) + nbytes > SUM_CHUNK:
            runs.append([])
            filled[dtype] = 0
        runs[-1].append(path)
        filled[dtype] = filled.get(dtype, 0) + nbytes
    out: dict[str, torch.Tensor] = {}
    for sum_dtype, paths in ((d, run) for d, runs in flat.items() for run in runs):
        sizes = [math.prod(layout.shapes[p]) for p in paths]
        buf = torch.zeros(sum(sizes), dtype=sum_dtype, device=device)
        views = dict(zip(paths, (v.view(layout.shapes[p]) for v, p in zip(buf.split(sizes), paths))))
        for path in paths:
            for box, t in mine[path].items():
                _box(views[path], box).copy_(t)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(buf)
        for path in paths:
            out[path] = views[path].to(layout.dtypes[path]).cpu().clone()
    return out


def full_state(layout: StateLayout, pieces: dict[str, torch.Tensor], rank: int,
               device: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    mine = {path: _mine(layout, path, pieces, rank)
            for path in dict.fromkeys(layout.keys.values())}  # the same order on every rank
    done = _wholes(layout, mine, device)
    for key, path in layout.keys.items():
        out[key] = done[path]
    out.update({k: v.detach().cpu().clone() for k, v in layout.fixed.items()})
    return out


def _placement(owner: int, rank: int, device: torch.device) -> str:
    """Where ``owner``'s shard lives: this rank's own device; another rank's, by its type (the
    index of a remote CUDA device is only a label: it is never checked)."""
    if owner == rank or device.type != "cuda":
        return f"rank:{owner}/{device}"
    return f"rank:{owner}/cuda:{owner % max(torch.cuda.device_count(), 1)}"


def sharded_state(layout: StateLayout, pieces: dict[str, torch.Tensor], rank: int,
                  device: torch.device) -> dict[str, Any]:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata, TensorProperties,
    )

    out: dict[str, Any] = {}
    done: dict[str, Any] = {}
    world = dist.get_world_size() if dist.is_initialized() else 1
    for key, path in layout.keys.items():
        if path not in done:
            shape, dtype = layout.shapes[path], layout.dtypes[path]
            mine = _mine(layout, path, pieces, rank)  # none on a rank of another pipeline stage
            metas = [ShardMetadata([a for a, _ in box], [b - a for a, b in box],
                                   _placement(owner, rank, device))
                     for box, owner in layout.pieces[path]]
            local = [Shard(mine[box].detach(), m) for (box, owner), m in zip(layout.pieces[path], metas)
                     if owner == rank]
            owners = {owner for _, owner in layout.pieces[path]}
            if shape:  # ranks that own no piece hold an empty one (ShardedTensor asks a
                # rank's shards for its device, and every rank must build the same metadata),
                # placed at the tensor's end: DCP takes chunks at one offset for copies of one
                for r in sorted(set(range(world)) - owners):
                    metas.append(ShardMetadata(list(shape), [0] * len(shape),
                                               _placement(r, rank, device)))
                    if r == rank:
                        local = [Shard(torch.empty([0] * len(shape), dtype=dtype, device=device),
                                       metas[-1])]
            meta = ShardedTensorMetadata(metas, torch.Size(shape), TensorProperties(dtype=dtype))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                done[path] = ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)
        out[key] = done[path]
    out.update({k: v.detach().clone() for k, v in layout.fixed.items()})
    return out


def load_full(layout: StateLayout, state: dict[str, Any], *, strict: bool, rank: int,
              device: Any) -> dict[str, torch.Tensor]:
    """Path → whole tensor, from whole tensors or the ShardedTensors of :func:`sharded_state`."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    known = set(layout.keys) | set(layout.fixed)
    problems = []
    if strict:
        missing = [k for k in layout.keys if k not in state]
        unexpected = [k for k in state if k not in known]
        if missing:
            problems.append(Problem(obj="load_state_dict", value=f"missing keys {missing[:5]}",
                                    rule="every parameter and buffer of the model is given",
                                    fix="pass the model's whole state_dict, or strict=False"))
        if unexpected:
            problems.append(Problem(obj="load_state_dict", value=f"unexpected keys {unexpected[:5]}",
                                    rule="keys are the model's own state_dict names",
                                    fix="drop them, or pass strict=False"))
    for key, path in layout.keys.items():
        v = state.get(key)
        if v is not None and tuple(v.size()) != layout.shapes[path]:
            problems.append(Problem(obj=f"state {key!r}", value=f"shape {tuple(v.size())}",
                                    rule=f"the model's {key} has shape {layout.shapes[path]}",
                                    fix="load a state of this model"))
    if problems:
        raise TorchweaveError(problems)
    out: dict[str, torch.Tensor] = {}
    for key, path in layout.keys.items():
        v = state.get(key)
        if v is None or path in out:
            continue
        if isinstance(v, ShardedTensor):
            mine = {}
            for shard in v.local_shards():
                m = shard.metadata
                mine[tuple((o, o + n) for o, n in zip(m.shard_offsets, m.shard_sizes))] = shard.tensor
            out[path] = _whole(layout, path, mine, device)
        else:
            out[path] = v.detach()
        for part, dim, start in layout.parts.get(path, ()):  # the ranks hold it as parts
            out[part] = out[path].narrow(dim, start, layout.shapes[part][dim])
    return out
