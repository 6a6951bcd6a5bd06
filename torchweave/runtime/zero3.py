"""ZeRO stage 3 at run time: gather parameters one unit at a time, FSDP-style.

Forward. The generated code reads ``p['path']`` just before a parameter's first
use and deletes it after its last. The first read of any piece of a unit
all-gathers the whole unit (or waits for its prefetch) through one autograd
node, :class:`_GatherUnit`, whose outputs are views of the gathered buffer;
the next unit's all-gather starts at once, asynchronously. Units are laid out
in first-read order, so opening unit u + 1 means every piece of unit u has
been read: u's buffer is released as soon as the generated code drops its
views (a piece read again later is gathered again).

Backward. Saved-tensor hooks save any view of a gathered unit as its place in
the unit, so the full parameters are not kept alive between the passes. The
first unpack of a unit gathers it again (recorded as a backward all-gather)
and prefetches the unit that backward is expected to need next (backward
keeps one unit gathered, besides a prefetch); the unit the forward ended with
is handed over without a collective. When every piece of a unit has its
gradient, the autograd engine runs :class:`_GatherUnit`'s backward once: it
packs the gradients into the unit's flat layout and starts an asynchronous
reduce-scatter. The results are added into ``master.grad`` as
they are waited for: when more than two are in flight, at the next forward
(micro-batches), and in ``finish_grads``.

Every rank of the group runs the same program, so every rank issues these
collectives in the same order.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Callable

import torch
from torch.autograd.function import once_differentiable

from torchweave.runtime.collectives import all_gather_single, reduce_scatter_single
from torchweave.runtime.counter import CommKind, Direction

CACHED = 1
"""Units backward keeps gathered (besides those handed over, and one prefetch)."""
IN_FLIGHT = 2
"""Reduce-scatters left running before backward waits for the oldest."""


class _GatherUnit(torch.autograd.Function):
    """Shards → one unit's pieces (views of one buffer); backward reduce-scatters."""

    @staticmethod
    def forward(ctx, master: torch.Tensor, s3: "Stage3", u: int):
        ctx.set_materialize_grads(False)
        ctx.s3, ctx.u = s3, u
        return tuple(s3.unit_pieces(u))

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor | None):
        ctx.s3.reduce_unit(ctx.u, grads)
        return None, None, None


class Stage3:
    """Gathers, prefetches, caches and reduce-scatters the units of one ZeroOptimizer."""

    def __init__(self, zero: Any) -> None:
        self.z, self.L = zero, zero.layout
        self.n_units = len(self.L.units)
        self.dtypes: list[torch.dtype | None] = [self.L.dtype] * self.n_units
        """Dtype each unit is gathered in (None: pieces of several dtypes; gathered in the
        master dtype)."""
        self.piece_dtypes: list[torch.dtype] = list(zero.dtypes)
        """Dtype each piece is handed out in (after the forward's cast)."""
        self.prefetched: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        """unit → (work, buffer, shard) of an all-gather in flight."""
        self.pending: collections.deque = collections.deque()
        """(unit, shard gradient, flat gradient, work) of reduce-scatters in flight."""
        self.current: tuple[int, tuple[torch.Tensor, ...]] | None = None
        """The unit the forward reads now, and its pieces."""
        self.done: set[int] = set()
        self.bases: dict[int, tuple[Any, int]] = {}
        """id(gathered buffer) → (weakref, unit), for this forward's buffers."""
        self.saved: list[int] = []
        """Units whose pieces were saved for backward, in the order first saved."""
        self.bwd: collections.OrderedDict = collections.OrderedDict()
        self.bwd_seen: set[int] = set()

    # ------------------------------------------------------------ collectives
    def _start(self, u: int, direction: Direction, async_op: bool):
        z, s, c = self.z, self.L.starts[u], self.L.cols[u]
        shard = z.master.detach()[s:s + c].to(self.dtypes[u] or self.L.dtype)
        buf = torch.empty(c * z.size, dtype=shard.dtype, device=shard.device)
        z.group_cache.counter.record(CommKind.ALL_GATHER, direction, z.group,
                            shard.numel() * shard.element_size())
        work = all_gather_single(buf, shard, group=z.pg, async_op=async_op)
        return work, buf, shard

    def _prefetch(self, u: int, direction: Direction) -> None:
        if u not in self.prefetched:
            self.prefetched[u] = self._start(u, direction, True)

    def _take(self, u: int, direction: Direction) -> torch.Tensor:
        """Unit ``u``'s gathered flat buffer: its prefetch, or a blocking all-gather."""
        got = self.prefetched.pop(u, None)
        if got is None:
            return self._start(u, direction, False)[1]
        got[0].wait()
        return got[1]

    def _wait_prefetches(self) -> None:
        for work, _, _ in self.prefetched.values():
            work.wait()
        self.prefetched.clear()

    def _drain(self, keep: int) -> None:
        z = self.z
        while len(self.pending) > keep:
            u, out, _, work = self.pending.popleft()
            work.wait()
            if z.master.grad is None:
                z.master.grad = torch.zeros_like(z.master, memory_format=torch.contiguous_format)
            s = self.L.starts[u]
            z.master.grad[s:s + out.numel()].add_(out)

    # ------------------------------------------------------------ forward
    def begin_forward(self, params: dict[str, torch.Tensor], cast: Callable) -> "LazyParams":
        self._drain(0)
        self._wait_prefetches()
        self.bwd.clear()
        self.current = None
        self.done.clear()
        self.bases.clear()
        self.saved = []
        to = {d: cast(torch.empty(0, dtype=d)).dtype for d in set(self.z.dtypes)}
        self.piece_dtypes = [to[d] for d in self.z.dtypes]
        for u, idx in enumerate(self.L.units):
            kinds = {self.piece_dtypes[i] for i in idx}
            self.dtypes[u] = kinds.pop() if len(kinds) == 1 else None
        return LazyParams(self, params, cast)

    def piece(self, i: int) -> torch.Tensor:
        u = self.L.unit_of[i]
        if self.current is None or self.current[0] != u:
            self.current = (u, _GatherUnit.apply(self.z.master, self, u))
            self.done.add(u)
            if u + 1 < self.n_units and u + 1 not in self.done:
                self._prefetch(u + 1, Direction.FORWARD)
        return self.current[1][self.L.pos[i]]

    def unit_pieces(self, u: int) -> list[torch.Tensor]:
        """Called by :class:`_GatherUnit`: gather unit ``u``; views of its pieces."""
        buf = self._take(u, Direction.FORWARD)
        self.bases[id(buf)] = (weakref.ref(buf), u)
        pieces = self.L.pieces(u, buf)
        if self.dtypes[u] is None:
            pieces = [t.to(self.piece_dtypes[i]) for t, i in zip(pieces, self.L.units[u])]
        return pieces

    def end_forward(self) -> None:
        """Release the forward's units; hand the last one (if saved) to backward."""
        self._wait_prefetches()
        if self.current is not None:
            u, outs = self.current
            if u in self.saved and self.dtypes[u] is not None:
                self.bwd[u] = outs[0]._base
        self.current = None
        self.bwd_seen.clear()

    # ------------------------------------------------------------ backward
    def pack(self, t: torch.Tensor) -> Any | None:
        """A gathered piece, saved by autograd: kept as its place in its unit (or None:
        not a piece of a unit); see :func:`torchweave.runtime.regather.forward_hooks`."""
        base = t._base if t._base is not None else t
        hit = self.bases.get(id(base))
        if hit is None or hit[0]() is not base:
            return None
        u = hit[1]
        if u not in self.saved:
            self.saved.append(u)
        return u, t.storage_offset(), tuple(t.shape), t.stride()

    def unpack(self, data: Any) -> torch.Tensor:
        u, offset, shape, stride = data
        return self._backward_unit(u).as_strided(shape, stride, offset)

    def _backward_unit(self, u: int) -> torch.Tensor:
        buf = self.bwd.get(u)
        if buf is None:
            buf = self._take(u, Direction.BACKWARD)
            self.bwd[u] = buf
            used = [v for v in self.bwd if v in self.bwd_seen]  # oldest first
            for v in used[:len(self.bwd) - CACHED]:  # units handed over stay until used
                del self.bwd[v]
        if u not in self.bwd_seen:  # first use in this backward: prefetch the next unit
            self.bwd_seen.add(u)
            order = self.saved[::-1]
            for v in order[order.index(u) + 1:] if u in order else ():
                if v not in self.bwd_seen and v not in self.bwd:
                    self._prefetch(v, Direction.BACKWARD)
                    break
        return buf

    def reduce_unit(self, u: int, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Start the reduce-scatter of unit ``u``'s gradient (all its pieces are done)."""
        z = self.z
        self.bwd.pop(u, None)
        flat = self.L.flat(u, list(grads), device=z.master.device)
        out = torch.empty(self.L.cols[u], dtype=flat.dtype, device=flat.device)
        z.group_cache.counter.record(CommKind.REDUCE_SCATTER, Direction.BACKWARD, z.group,
                            flat.numel() * flat.element_size())
        work = reduce_scatter_single(out, flat, group=z.pg, async_op=True)
        self.pending.append((u, out, flat, work))
        self._drain(IN_FLIGHT)

    def finish_grads(self) -> None:
        self._drain(0)
        self._wait_prefetches()
        self.bwd.clear()
        self.bwd_seen.clear()


class LazyParams(dict):
    """Stage 3: reading an owned parameter hands out a view of its gathered unit."""

    def __init__(self, s3: Stage3, params: dict[str, torch.Tensor],
                 cast: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(params)
        self.s3, self.cast = s3, cast

    def __getitem__(self, path: str) -> torch.Tensor:
        p = super().__getitem__(path)
        i = self.s3.z._owned_ids.get(id(p))
        return self.cast(p) if i is None else self.s3.piece(i)
