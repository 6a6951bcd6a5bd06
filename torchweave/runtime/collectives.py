"""Autograd-aware collectives over a group of global ranks.

Each function takes this rank's local tensor and returns a new local tensor.
A group is a tuple of global ranks; its members are ordered by sorted global
rank, and member ``i`` holds chunk ``i`` along a split axis.

Gradients follow the R-grad convention: a tensor replicated on a group holds
identical, full gradients on every member; each piece of a partial sum
receives the full gradient of the sum. So the duals are:

=================  =====================  ==============================
function           forward                backward
=================  =====================  ==============================
all_reduce         sum (P -> R)           identity, or all-reduce
all_gather         concat (S -> R)        own slice, or reduce-scatter
reduce_scatter     sum, own chunk (P->S)  all-gather
split              own chunk (R -> S)     all-gather
all_to_all         S(cat) -> S(split)     all-to-all S(split) -> S(cat)
routed exchange    see runtime/routed.py
grad_all_reduce    identity               all-reduce
grad_scale         identity               times factor
=================  =====================  ==============================

The same code runs on gloo (CPU) and NCCL (GPU): buffers follow the input's
device, and every buffer handed to a collective is contiguous.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from torchweave.errors import Problem, TorchweaveError
from torchweave.runtime.counter import CommKind, Direction
from torchweave.runtime.groups import GroupCache
from torchweave.runtime.regather import REGATHER

# torch 2.13 deprecates the *_into_tensor / *_tensor names; older releases lack *_single.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

FWD, BWD = Direction.FORWARD, Direction.BACKWARD


class CommError(TorchweaveError):
    """A collective called with arguments that cannot work."""


@dataclass(frozen=True)
class _Group:
    """A resolved group: ranks, process group, this rank's index."""

    group_cache: GroupCache
    ranks: tuple[int, ...]
    pg: dist.ProcessGroup
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def record(self, kind: CommKind, direction: Direction, x: torch.Tensor) -> None:
        self.group_cache.counter.record(kind, direction, self.ranks, x.numel() * x.element_size())


def _resolve(group_cache: GroupCache, group: Sequence[int], op: str) -> _Group:
    ranks = group_cache.normalize(group)
    if group_cache.rank not in ranks:
        raise CommError(Problem(
            obj=f"{op} on group {ranks}", value=f"called on rank {group_cache.rank}",
            rule="only members of a group may call its collectives",
            fix="call it only on the ranks in the group"))
    return _Group(group_cache, ranks, group_cache.get(ranks), ranks.index(group_cache.rank))


def _axis(x: torch.Tensor, axis: int, op: str) -> int:
    if x.dim() == 0 or not -x.dim() <= axis < x.dim():
        raise CommError(Problem(obj=f"{op} axis", value=str(axis),
                                rule=f"axis must index a tensor of shape {tuple(x.shape)}"))
    return axis % x.dim()


def _check_divisible(x: torch.Tensor, axis: int, g: _Group, op: str) -> None:
    if x.shape[axis] % g.size:
        raise CommError(Problem(
            obj=f"{op} on group {g.ranks}",
            value=f"shape {tuple(x.shape)}, axis {axis} of size {x.shape[axis]}",
            rule=f"the axis size must divide evenly by the group size {g.size}",
            fix="pad the tensor, or use exchange() for an uneven layout"))


# ---- raw collectives (no autograd), used by forward and backward alike ----

def _raw_all_reduce(g: _Group, x: torch.Tensor, d: Direction) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    g.record(CommKind.ALL_REDUCE, d, out)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=g.pg)
    return out


def _raw_all_gather(g: _Group, x: torch.Tensor, axis: int, d: Direction) -> torch.Tensor:
    return _start_all_gather(g, x, axis, d, async_op=False)()


def _start_all_gather(g: _Group, x: torch.Tensor, axis: int, d: Direction, *,
                      async_op: bool = True) -> Callable[[], torch.Tensor]:
    """Start the all-gather; the returned call waits for it and gives the result."""
    front = x.movedim(axis, 0).contiguous()
    out = front.new_empty((g.size * front.shape[0], *front.shape[1:]))
    g.record(CommKind.ALL_GATHER, d, front)
    work = all_gather_single(out, front, group=g.pg, async_op=async_op)

    def result() -> torch.Tensor:
        if work is not None:
            work.wait()
        # along axis 0 the buffer is the result (not a view of it: regather.py notes it)
        return out if axis == 0 else out.movedim(0, axis).contiguous()
    return result


def _raw_reduce_scatter(g: _Group, x: torch.Tensor, axis: int, d: Direction) -> torch.Tensor:
    front = x.movedim(axis, 0).contiguous()
    out = front.new_empty((front.shape[0] // g.size, *front.shape[1:]))
    g.record(CommKind.REDUCE_SCATTER, d, front)
    reduce_scatter_single(out, front, op=dist.ReduceOp.SUM, group=g.pg)
    return out.movedim(0, axis).contiguous()


def _raw_all_to_all(g: _Group, x: torch.Tensor, split_axis: int, cat_axis: int,
                    d: Direction) -> torch.Tensor:
    n = g.size
    front = x.movedim(split_axis, 0)
    send = front.reshape(n, front.shape[0] // n, *front.shape[1:]).contiguous()
    recv = torch.empty_like(send)
    g.record(CommKind.ALL_TO_ALL, d, send)
    dist.all_to_all_single(recv, send, group=g.pg)
    # recv[i] is member i's chunk (split axis in front); restore the chunk's
    # axis order, then merge the member axis into cat_axis (member-major).
    chunks = recv.movedim(1, split_axis + 1)
    merged = chunks.movedim(0, cat_axis)
    shape = list(chunks.shape[1:])
    shape[cat_axis] *= n
    return merged.reshape(shape).contiguous()


def _own_chunk(g: _Group, x: torch.Tensor, axis: int) -> torch.Tensor:
    size = x.shape[axis] // g.size
    return x.narrow(axis, g.index * size, size).contiguous()


# ---- autograd functions ----

class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g: _Group, bwd_reduce: bool):
        ctx.g, ctx.bwd_reduce = g, bwd_reduce
        return _raw_all_reduce(g, x, FWD)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        return (_raw_all_reduce(ctx.g, dy, BWD) if ctx.bwd_reduce else dy), None, None


class _AllReduceLSE(torch.autograd.Function):
    """Partial log-sum-exps → the log-sum-exp: ``m + log Σ exp(x − m)``, m the max."""

    @staticmethod
    def forward(ctx, x, g: _Group, bwd_reduce: bool):
        m = x.detach().clone()
        g.record(CommKind.ALL_REDUCE, FWD, m)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=g.pg)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        out = m + torch.log(_raw_all_reduce(g, torch.exp(x - m), FWD))
        ctx.g, ctx.bwd_reduce = g, bwd_reduce
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, out = ctx.saved_tensors
        if ctx.bwd_reduce:
            dy = _raw_all_reduce(ctx.g, dy, BWD)
        return dy * torch.exp(x - out), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g: _Group, axis: int, bwd_reduce: bool):
        ctx.g, ctx.axis, ctx.bwd_reduce = g, axis, bwd_reduce
        return _raw_all_gather(g, x, axis, FWD)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        g, axis = ctx.g, ctx.axis
        dx = _raw_reduce_scatter(g, dy, axis, BWD) if ctx.bwd_reduce else _own_chunk(g, dy, axis)
        return dx, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g: _Group, axis: int):
        ctx.g, ctx.axis = g, axis
        return _raw_reduce_scatter(g, x, axis, FWD)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        return _raw_all_gather(ctx.g, dy, ctx.axis, BWD), None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g: _Group, axis: int):
        ctx.g, ctx.axis = g, axis
        return _own_chunk(g, x, axis)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        return _raw_all_gather(ctx.g, dy, ctx.axis, BWD), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g: _Group, split_axis: int, cat_axis: int):
        ctx.g, ctx.split_axis, ctx.cat_axis = g, split_axis, cat_axis
        return _raw_all_to_all(g, x, split_axis, cat_axis, FWD)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        return _raw_all_to_all(ctx.g, dy, ctx.cat_axis, ctx.split_axis, BWD), None, None, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g: _Group):
        ctx.g = g
        return x.view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        return _raw_all_reduce(ctx.g, dy, BWD), None


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        return dy * ctx.factor, None


# ---- public API ----

def all_reduce(group_cache: GroupCache, x: torch.Tensor, group: Sequence[int], *,
               bwd: Literal["identity", "all_reduce"] = "identity") -> torch.Tensor:
    """Sum over the group (P -> R). ``bwd``: identity (R-grad), or all-reduce."""
    _check_choice("all_reduce bwd", bwd, ("identity", "all_reduce"))
    return _AllReduce.apply(x, _resolve(group_cache, group, "all_reduce"), bwd == "all_reduce")


def all_reduce_lse(group_cache: GroupCache, x: torch.Tensor, group: Sequence[int], *,
                   bwd: Literal["identity", "all_reduce"] = "identity") -> torch.Tensor:
    """Combine partial log-sum-exps over the group (P(lse) -> R); backward scales
    each term's gradient by its share ``exp(x − result)``."""
    _check_choice("all_reduce_lse bwd", bwd, ("identity", "all_reduce"))
    return _AllReduceLSE.apply(x, _resolve(group_cache, group, "all_reduce_lse"), bwd == "all_reduce")


def all_gather(group_cache: GroupCache, x: torch.Tensor, group: Sequence[int], axis: int, *,
               bwd: Literal["slice", "reduce_scatter"] = "slice",
               regather: bool = False) -> torch.Tensor:
    """Concatenate members' pieces along ``axis`` (S -> R).

    ``bwd``: this member's slice of the gradient (R-grad), or reduce-scatter.
    ``regather``: what autograd saves of the result is kept as ``x`` and gathered again
    in backward (:mod:`torchweave.runtime.regather`).
    """
    _check_choice("all_gather bwd", bwd, ("slice", "reduce_scatter"))
    g = _resolve(group_cache, group, "all_gather")
    ax = _axis(x, axis, "all_gather")
    out = _AllGather.apply(x, g, ax, bwd == "reduce_scatter")
    if regather:
        REGATHER.note(out, x.detach(), g.ranks, lambda shard: _start_all_gather(g, shard, ax, BWD))
    return out


def reduce_scatter(group_cache: GroupCache, x: torch.Tensor, group: Sequence[int],
                   axis: int) -> torch.Tensor:
    """Sum over the group and keep this member's chunk along ``axis`` (P -> S)."""
    g = _resolve(group_cache, group, "reduce_scatter")
    axis = _axis(x, axis, "reduce_scatter")
    _check_divisible(x, axis, g, "reduce_scatter")
    return _ReduceScatter.apply(x, g, axis)


def split(group_cache: GroupCache, x: torch.Tensor, group: Sequence[int], axis: int) -> torch.Tensor:
    """Keep this member's chunk along ``axis`` (R -> S); no communication forward."""
    g = _resolve(group_cache, group, "split")
    axis = _axis(x, axis, "split")
    _check_divisible(x, axis, g, "split")
    return _Split.apply(x, g, axis)


def all_to_all(group_cache: GroupCache, x: torch.Tensor, group: Sequence[int], split_axis: int,
               cat_axis: int) -> torch.Tensor:
    """Send chunk j along ``split_axis`` to member j; concatenate what arrives along ``cat_axis``.

    On a tensor sharded along ``cat_axis`` (S(cat)), this reshards it along
    ``split_axis`` (S(split)).
    """
    g = _resolve(group_cache, group, "all_to_all")
    split_axis = _axis(x, split_axis, "all_to_all")
    cat_axis = _axis(x, cat_axis, "all_to_all")
    _check_divisible(x, split_axis, g, "all_to_all")
    return _AllToAll.apply(x, g, split_axis, cat_axis)


def route(group_cache: GroupCache, index: torch.Tensor, group: Sequence[int], *,
          owners: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The routed exchange (:mod:`torchweave.runtime.routed`): ``index``'s rows routed."""
    from torchweave.runtime import routed  # it builds on this module
    return routed.route(_resolve(group_cache, group, "route"), index, owners)


def dispatch(group_cache: GroupCache, x: torch.Tensor, group: Sequence[int], *,
             route: torch.Tensor) -> torch.Tensor:
    """``x``'s rows sent as the routed index ``route``'s were."""
    from torchweave.runtime import routed
    return routed.dispatch(x, route)


def combine(group_cache: GroupCache, y: torch.Tensor, group: Sequence[int], *,
            route: torch.Tensor) -> torch.Tensor:
    """Routed rows' partial results ``y`` summed back into their source rows."""
    from torchweave.runtime import routed
    return routed.combine(y, route)


def grad_all_reduce(group_cache: GroupCache, x: torch.Tensor, group: Sequence[int]) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (Megatron's ``f``)."""
    return _GradAllReduce.apply(x, _resolve(group_cache, group, "grad_all_reduce"))


def grad_scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Identity forward; the gradient times ``factor`` backward."""
    return _GradScale.apply(x, factor)


def exchange(group_cache: GroupCache, sends: Sequence[tuple[int, torch.Tensor]],
             recv_specs: Sequence[tuple[int, Sequence[int], torch.dtype]]) -> list[torch.Tensor]:
    """Point-to-point transfers for irregular layouts; not differentiable.

    ``sends`` is ``[(dst_rank, tensor)]``; ``recv_specs`` is
    ``[(src_rank, shape, dtype)]``. Returns the received tensors, in the order
    of ``recv_specs``, on ``group_cache.device``. Several transfers between one pair of
    ranks match in the order they are listed on both sides.
    """
    peers = [dst for dst, _ in sends] + [src for src, _, _ in recv_specs]
    world, me = group_cache.world_size, group_cache.rank
    bad = [p for p in peers if not isinstance(p, int) or not 0 <= p < world or p == me]
    if bad:
        raise CommError(Problem(
            obj=f"exchange on rank {group_cache.rank}", value=f"peers {bad}",
            rule=f"peers are other ranks in [0, world_size={group_cache.world_size})",
            fix="keep pieces that stay on this rank out of the exchange"))
    ops, received, nbytes = [], [], 0
    for dst, t in sends:
        t = t.detach().contiguous().to(group_cache.p2p_device)
        nbytes += t.numel() * t.element_size()
        ops.append(dist.P2POp(dist.isend, t, peer=dst))
    for src, shape, dtype in recv_specs:
        buf = torch.empty(tuple(shape), dtype=dtype, device=group_cache.p2p_device)
        received.append(buf)
        ops.append(dist.P2POp(dist.irecv, buf, peer=src))
    if not ops:
        return received
    group_cache.counter.record(CommKind.P2P, FWD, group_cache.world, nbytes)
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return [buf.to(group_cache.device) for buf in received]


def _check_choice(what: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise CommError(Problem(obj=what, value=repr(value), rule=f"one of {allowed}"))
