"""The routed exchange: rows sent only where an index routes them (a ragged all-to-all).

An op whose output is a sum over a dim ``e`` that one of its inputs indexes (a
mixture-of-experts layer: token ``t`` reads experts ``index[t, :]``) declares that relation
(:attr:`torchweave.ops.registry.OpSpec.route`). Where a plan splits ``e`` over a group whose
members hold different rows, lowering derives this exchange (:mod:`torchweave.lower.route`)
in place of gathering every row onto every member and reduce-scattering the partial sums:

* :func:`route`: each member sends each row of its index to every member owning one of the
  row's coordinates; the receiver gets the rows routed to it, in source order. The received
  index carries the :class:`Route` (which rows went where, how many came from whom).
* :func:`dispatch`: any other per-row tensor, sent the same way. Backward sends the
  gradients back and sums them per source row.
* :func:`combine`: the op's partial sums on the received rows, sent back and summed into
  each source row. Backward sends each row's gradient to every member that computed a term.

A row goes to a member once however many of its coordinates that member owns, so the bytes
are ``rows × members reached``: with ``k`` of ``E`` experts per token over ``n`` members, a
balanced router reaches ``n · (1 − C(E − E/n, k) / C(E, k))`` members per row, at most
``min(k, n)``, against the ``n`` of a gather (:func:`torchweave.lower.steps.reach`). Split sizes are known when the
step runs: one small all-to-all of counts, then the rows. The same code runs on gloo and NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from torchweave.runtime.counter import CommKind, Direction

if TYPE_CHECKING:
    from torchweave.runtime.collectives import _Group

FWD, BWD = Direction.FORWARD, Direction.BACKWARD
ATTR = "_torchweave_route"
"""The attribute of a routed index that holds its :class:`Route`."""


@dataclass(frozen=True)
class Route:
    """Where one member's rows went: ``rows`` (local row numbers, grouped by destination in
    group order) in ``send`` counts, and ``recv`` counts received from each member."""

    g: _Group
    rows: torch.Tensor
    send: list[int]
    recv: list[int]
    local_rows: int


def _exchange(g: _Group, x: torch.Tensor, send: list[int], recv: list[int],
              d: Direction) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    g.record(CommKind.ALL_TO_ALL, d, x)
    dist.all_to_all_single(out, x, recv, send, group=g.pg)
    return out


def route(g: _Group, index: torch.Tensor, owners: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The rows of ``index [rows, k]`` routed to this member, carrying their :class:`Route`;
    ``owners[m]`` is member ``m``'s range of coordinates."""
    lo = torch.tensor([a for a, _ in owners], device=index.device, dtype=index.dtype)
    hi = torch.tensor([b for _, b in owners], device=index.device, dtype=index.dtype)
    flat = index.reshape(index.shape[0], -1, 1)
    reached = ((flat >= lo) & (flat < hi)).any(dim=1)  # [rows, members]
    member, rows = reached.t().nonzero(as_tuple=True)  # grouped by member, rows ascending
    send_counts = torch.bincount(member, minlength=g.size)
    recv_counts = torch.empty_like(send_counts)
    g.record(CommKind.ALL_TO_ALL, FWD, send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=g.pg)
    send, recv = send_counts.tolist(), recv_counts.tolist()  # one host read: the split sizes
    out = _exchange(g, index[rows], send, recv, FWD)
    setattr(out, ATTR, Route(g, rows, send, recv, index.shape[0]))
    return out


def route_of(index: torch.Tensor) -> Route:
    found = getattr(index, ATTR, None)
    if found is None:
        raise TypeError("a routed exchange needs the index that route() returned")
    return found


def _sum_back(r: Route, back: torch.Tensor) -> torch.Tensor:
    """``back`` (rows in ``r.rows``' order) summed into this member's rows: one slice per
    member, whose rows are distinct, so the sum is the same on every run (no atomics racing
    on a row) and runs in member order."""
    out = back.new_zeros((r.local_rows, *back.shape[1:]))
    at = 0
    for n in r.send:
        if n:
            out.index_add_(0, r.rows[at:at + n], back[at:at + n])
        at += n
    return out


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, r: Route):
        ctx.r = r
        return _exchange(r.g, x[r.rows], r.send, r.recv, FWD)

    @staticmethod
    def backward(ctx, dy):
        r = ctx.r
        return _sum_back(r, _exchange(r.g, dy, r.recv, r.send, BWD)), None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, r: Route):
        ctx.r = r
        return _sum_back(r, _exchange(r.g, y, r.recv, r.send, FWD))

    @staticmethod
    def backward(ctx, dout):
        r = ctx.r
        return _exchange(r.g, dout[r.rows], r.send, r.recv, BWD), None


def dispatch(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows of ``x`` sent as ``index``'s route sent the index's."""
    r = route_of(index)
    if not x.is_floating_point():
        return _exchange(r.g, x[r.rows], r.send, r.recv, FWD)
    return _Dispatch.apply(x, r)


def combine(y: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Each received row's partial result ``y`` sent back and summed into its source row."""
    return _Combine.apply(y, route_of(index))
