"""ZeRO stages 1–3 over one group of ranks that hold the same parameter pieces.

Every parameter piece replicated over the group is flattened, padded to a
multiple of the group size and cut into one chunk per member. A member keeps
fp32 master weights and optimizer state for its chunks only.

- stage 1: gradients are all-reduced; each member updates its chunk;
- stage 2: gradients are reduce-scattered, so a member keeps only its chunk;
- stage 3: parameters too are kept as chunks; each is all-gathered when the
  forward pass reads it, freed after, and gathered again when backward needs it.

After the update, stages 1 and 2 all-gather the chunks back into the pieces.
Collectives are bucketed: all chunks are laid out as one ``[group, C]`` buffer.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from torchweave.runtime.comm import all_gather_single, reduce_scatter_single
from torchweave.runtime.counter import CommKind, Direction
from torchweave.runtime.groups import GroupCache


class _Chunked:
    """Layout of every owned piece inside the ``[group, C]`` buffer."""

    def __init__(self, pieces: list[torch.Tensor], size: int) -> None:
        self.shapes = [tuple(p.shape) for p in pieces]
        self.numels = [p.numel() for p in pieces]
        self.cols = [math.ceil(n / size) for n in self.numels]
        self.offsets = [sum(self.cols[:i]) for i in range(len(pieces))]
        self.size = size
        self.total = sum(self.cols)

    def to_rows(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Pieces → ``[group, C]`` (row k is member k's chunk of every piece)."""
        rows = []
        for t, n, c in zip(tensors, self.numels, self.cols):
            flat = torch.nn.functional.pad(t.reshape(-1).float(), (0, c * self.size - n))
            rows.append(flat.view(self.size, c))
        return torch.cat(rows, dim=1)

    def from_rows(self, rows: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for shape, n, c, o in zip(self.shapes, self.numels, self.cols, self.offsets):
            out.append(rows[:, o:o + c].reshape(-1)[:n].view(shape))
        return out


class _Gather(torch.autograd.Function):
    """Stage 3: chunk → full piece; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, chunk: torch.Tensor, zero: "ZeroOptimizer", i: int) -> torch.Tensor:
        ctx.zero, ctx.i = zero, i
        return zero.gather_one(chunk, i)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        zero, i = ctx.zero, ctx.i
        c, n = zero.layout.cols[i], zero.layout.numels[i]
        flat = torch.nn.functional.pad(grad.reshape(-1).float(), (0, c * zero.size - n))
        out = torch.empty(c, dtype=flat.dtype, device=flat.device)
        zero.gc.counter.record(CommKind.REDUCE_SCATTER, Direction.BACKWARD, zero.group,
                               flat.numel() * flat.element_size())
        reduce_scatter_single(out, flat.contiguous(), group=zero.pg)
        return out, None, None


class ZeroOptimizer:
    """Sharded optimizer (and, at stage 3, sharded parameters) over ``group``."""

    def __init__(self, gc: GroupCache, trainable: list[tuple[torch.Tensor, Any]],
                 group: tuple[int, ...] | None, *, stage: int,
                 factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> None:
        assert group is not None and gc.rank in group
        self.gc, self.group, self.stage = gc, tuple(group), stage
        self.pg = gc.get(self.group)
        self.size, self.index = len(group), list(group).index(gc.rank)
        self.owned = [p for p, slot in trainable if self.group in slot.grad_groups]
        self.replicas = [slot.replicas for p, slot in trainable if self.group in slot.grad_groups]
        self._owned_ids = {id(p): i for i, p in enumerate(self.owned)}
        self.layout = _Chunked(self.owned, self.size)
        rows = self.layout.to_rows([p.detach() for p in self.owned])
        self.master = rows[self.index].clone().requires_grad_(True)
        self.inner = factory([self.master])
        self.sync_enabled = True
        self.dtypes = [p.dtype for p in self.owned]
        self.gathered: dict[int, tuple[Any, int]] = {}
        """id → (weakref, piece index) of stage-3 pieces gathered in this forward."""
        if stage == 3:
            for p in self.owned:  # the pieces themselves are no longer kept
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def owns(self, p: torch.Tensor) -> bool:
        return id(p) in self._owned_ids

    # ------------------------------------------------------------ stage 3 forward
    def gather_one(self, chunk: torch.Tensor, i: int) -> torch.Tensor:
        c, n = self.layout.cols[i], self.layout.numels[i]
        full = torch.empty(c * self.size, dtype=chunk.dtype, device=chunk.device)
        self.gc.counter.record(CommKind.ALL_GATHER, Direction.FORWARD, self.group,
                               full.numel() * full.element_size())
        all_gather_single(full, chunk.contiguous(), group=self.pg)
        return full[:n].view(self.layout.shapes[i]).to(self.dtypes[i])

    def view(self, params: dict[str, torch.Tensor], cast: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        if self.stage < 3:
            return {k: cast(v) for k, v in params.items()}
        return _LazyParams(self, params, cast)

    def saved_tensor_hooks(self, cast: Callable[[torch.Tensor], torch.Tensor]):
        """Stage 3: save gathered pieces as their index; gather again in backward."""

        def pack(t: torch.Tensor) -> Any:
            entry = self.gathered.get(id(t))
            if entry is not None and entry[0]() is t:
                return ("zero3", entry[1])
            return t

        def unpack(x: Any) -> torch.Tensor:
            if isinstance(x, tuple) and x and x[0] == "zero3":
                i = x[1]
                with torch.no_grad():
                    return cast(self.gather_one(self.chunk_of(i).detach(), i))
            return x

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def chunk_of(self, i: int) -> torch.Tensor:
        o, c = self.layout.offsets[i], self.layout.cols[i]
        return self.master[o:o + c]

    # ------------------------------------------------------------ gradients and step
    def finish_grads(self) -> None:
        if self.stage == 3:
            return  # _Gather's backward already reduce-scattered into master.grad
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.owned]
        rows = self.layout.to_rows(grads)
        nbytes = rows.numel() * rows.element_size()
        if self.stage == 1:
            self.gc.counter.record(CommKind.ALL_REDUCE, Direction.BACKWARD, self.group, nbytes)
            dist.all_reduce(rows, group=self.pg)
            mine = rows[self.index].clone()
        else:
            self.gc.counter.record(CommKind.REDUCE_SCATTER, Direction.BACKWARD, self.group, nbytes)
            mine = torch.empty(self.layout.total, dtype=rows.dtype, device=rows.device)
            reduce_scatter_single(mine, rows.reshape(-1).contiguous(), group=self.pg)
        for p in self.owned:
            p.grad = None
        self.master.grad = mine

    def grad_sq_norm(self) -> torch.Tensor:
        """This member's share of the squared global norm (the caller sums over the world)."""
        g = self.master.grad
        sq = torch.zeros((), dtype=torch.float64, device=self.master.device)
        if g is None:
            return sq
        for i, reps in enumerate(self.replicas):
            o, c = self.layout.offsets[i], self.layout.cols[i]
            sq += g[o:o + c].double().pow(2).sum() * (self.size / reps)
        return sq

    def scale_grads(self, factor: float) -> None:
        if self.master.grad is not None:
            self.master.grad.mul_(factor)

    def step(self) -> None:
        self.inner.step()
        self.inner.zero_grad(set_to_none=True)
        if self.stage == 3:
            return
        rows = self._gather_rows(self.master.detach())
        with torch.no_grad():
            for p, full in zip(self.owned, self.layout.from_rows(rows)):
                p.copy_(full)

    def _gather_rows(self, chunk: torch.Tensor) -> torch.Tensor:
        """Every member's ``[C]`` chunk → ``[group, C]``."""
        flat = torch.empty(self.size * self.layout.total, dtype=chunk.dtype, device=chunk.device)
        self.gc.counter.record(CommKind.ALL_GATHER, Direction.FORWARD, self.group,
                               flat.numel() * flat.element_size())
        all_gather_single(flat, chunk.contiguous(), group=self.pg)
        return flat.view(self.size, self.layout.total)

    # ------------------------------------------------------------ inspection
    def full_params(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.stage < 3:
            return params
        out = dict(params)
        with torch.no_grad():
            for path, p in params.items():
                if self.owns(p):
                    i = self._owned_ids[id(p)]
                    out[path] = self.gather_one(self.chunk_of(i).detach(), i)
        return out

    def full_grads(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        """Gradients of every piece (owned ones gathered from their chunks)."""
        rows = self._gather_rows(self.master.grad)
        fulls = self.layout.from_rows(rows)
        return {path: fulls[self._owned_ids[id(p)]] if self.owns(p) else p.grad
                for path, p in params.items()}


class _LazyParams(dict):
    """Stage 3: reading an owned parameter gathers it (differentiably)."""

    def __init__(self, zero: ZeroOptimizer, params: dict[str, torch.Tensor],
                 cast: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(params)
        self.zero, self.cast = zero, cast

    def __getitem__(self, path: str) -> torch.Tensor:
        p = super().__getitem__(path)
        z = self.zero
        if not z.owns(p):
            return self.cast(p)
        i = z._owned_ids[id(p)]
        full = self.cast(_Gather.apply(z.chunk_of(i), z, i))
        z.gathered[id(full)] = (weakref.ref(full), i)
        return full
