"""ZeRO stages 1–3 over one group of ranks that hold the same parameter pieces.

Every parameter piece replicated over the group is owned. Owned pieces, in the
order the generated code first reads them, are grouped into *units*: the
pieces of one module block (``blocks.3.``), or consecutive pieces outside any
numbered block, up to a byte budget (the rule is :mod:`torchweave.lower.units`,
which the simulator reads too). A unit is flattened, padded to a multiple
of the group size and cut into one contiguous shard per member, so one
all-gather rebuilds a whole unit and one reduce-scatter shards its gradient.
A member keeps fp32 master weights and optimizer state for its shards only.

- stage 1: gradients are all-reduced; each member updates its shards;
- stage 2: gradients are reduce-scattered, so a member keeps only its shards;
- stage 3: parameters too are kept as shards; a unit is all-gathered when the
  forward pass first reads one of its pieces (the next unit is prefetched),
  released after, gathered again when backward needs it, and its gradient is
  reduce-scattered asynchronously once all its pieces' gradients exist (see
  :mod:`torchweave.runtime.zero3`).

After the update, stages 1 and 2 all-gather the shards back into the pieces.
Stages 1 and 2 move all units in one collective: the units are laid out side by
side as one ``[group, C]`` buffer (row k is member k's shard of every unit).

Stages 1 and 2 need no units (nothing is gathered piece by piece), so their owned
pieces are one unit: one flat buffer whose member-k shard is a contiguous slice. Where
every owned piece has the master's dtype (fp32 pieces, as bf16 compute keeps them too;
fp64), the pieces *are* views of that buffer and the master shard is this member's slice
of it: the optimizer updates the member's elements of the pieces in place, and the
all-gather after the step writes the others straight into them. No second copy of the
member's shard is kept, and no gathered buffer is copied into the pieces.

Their gradients are held once: as backward finishes each piece's gradient (a hook after
autograd accumulates it), it is moved into its place in one flat buffer laid out as the
unit, whose rows are then the sum's input, and the piece's ``.grad`` is dropped. Before,
every piece's gradient stayed until the end of backward and was copied into a new flat
buffer, and that again into the rows: three whole-model gradients at the peak. The
buffer is made at the step's first gradient, while most activations are still held, so
the step's peak is the activations plus one whole gradient; before, without
accumulation, it was the larger of the activations and three whole gradients (with
accumulation, the gradients were held from the first micro-batch anyway). A step whose
activations exceed twice its gradients now peaks higher, by at most one gradient.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from torchweave.lower.program import zero_owns
from torchweave.lower.units import UNIT_BYTES, group_units, unit_key
from torchweave.runtime.collectives import all_gather_single, reduce_scatter_single
from torchweave.runtime.counter import CommKind, Direction
from torchweave.runtime.groups import GroupCache

class _Units:
    """Layout of the owned pieces: units, each one flat buffer cut into ``size`` shards."""

    def __init__(self, pieces: list[torch.Tensor], keys: list[str], size: int,
                 budget: int = UNIT_BYTES, device: torch.device | None = None) -> None:
        self.size, self.device = size, device
        """``device``: where rows live when this member owns no piece (NCCL refuses a CPU tensor)."""
        self.dtype = torch.float64 if any(p.dtype == torch.float64 for p in pieces) else torch.float32
        """Master weights, optimizer state and gradient shards: fp32, or fp64 for a float64 model."""
        self.shapes = [tuple(p.shape) for p in pieces]
        self.numels = [p.numel() for p in pieces]
        self.units: list[list[int]] = group_units(keys, [4 * n for n in self.numels], budget)
        """Piece indices of each unit (consecutive; :mod:`torchweave.lower.units`)."""
        self.unit_of = [0] * len(pieces)
        self.pos = [0] * len(pieces)
        """Index of the piece inside its unit."""
        self.offsets = [0] * len(pieces)
        """Offset of the piece inside its unit's flat buffer."""
        self.cols, self.starts = [], []
        """Shard length of each unit, and where it starts in a member's row."""
        for u, idx in enumerate(self.units):
            off = 0
            for k, i in enumerate(idx):
                self.unit_of[i], self.pos[i], self.offsets[i] = u, k, off
                off += self.numels[i]
            self.starts.append(sum(self.cols))
            self.cols.append(math.ceil(off / size))
        self.total = sum(self.cols)

    def flat(self, u: int, tensors: list[torch.Tensor | None], *,
             dtype: torch.dtype | None = None, device: Any = None) -> torch.Tensor:
        """Unit ``u``'s pieces (``None``: zeros) → its padded flat buffer (master dtype by default)."""
        buf = torch.empty(self.cols[u] * self.size, dtype=dtype or self.dtype, device=device)
        end = 0
        for i, t in zip(self.units[u], tensors):
            o, n = self.offsets[i], self.numels[i]
            if t is None:
                buf[o:o + n].zero_()
            else:
                buf[o:o + n].view(self.shapes[i]).copy_(t)
            end = o + n
        buf[end:].zero_()
        return buf

    def pieces(self, u: int, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of unit ``u``'s pieces in its flat buffer."""
        return [flat[self.offsets[i]:self.offsets[i] + self.numels[i]].view(self.shapes[i])
                for i in self.units[u]]

    def to_rows(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Pieces → ``[group, C]`` (row k is member k's shard of every unit)."""
        dev = tensors[0].device if tensors else self.device
        if len(self.units) == 1:  # one unit's flat buffer is the rows already: no second copy
            return self.flat(0, tensors, device=dev).view(self.size, self.total)
        rows = torch.empty(self.size, self.total, dtype=self.dtype, device=dev)
        for u, idx in enumerate(self.units):
            s, c = self.starts[u], self.cols[u]
            rows[:, s:s + c] = self.flat(u, [tensors[i] for i in idx], device=dev).view(self.size, c)
        return rows

    def from_rows(self, rows: torch.Tensor) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for u in range(len(self.units)):
            s, c = self.starts[u], self.cols[u]
            out += self.pieces(u, rows[:, s:s + c].reshape(-1))
        return out

    def segments(self, index: int) -> list[tuple[int, int, int]]:
        """``(start, end, piece)`` spans of member ``index``'s row that hold a piece."""
        out = []
        for u, idx in enumerate(self.units):
            lo, c = index * self.cols[u], self.cols[u]
            for i in idx:
                a = max(self.offsets[i], lo)
                b = min(self.offsets[i] + self.numels[i], lo + c)
                if a < b:
                    out.append((self.starts[u] + a - lo, self.starts[u] + b - lo, i))
        return out


class ZeroOptimizer:
    """Sharded optimizer (and, at stage 3, sharded parameters) over ``group``."""

    def __init__(self, group_cache: GroupCache, trainable: list[tuple[torch.Tensor, Any]],
                 group: tuple[int, ...] | None, *, stage: int,
                 factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                 order: list[str] | None = None) -> None:
        """``order``: parameter paths in the order the forward first reads them."""
        assert group is not None and group_cache.rank in group
        self.group_cache, self.group, self.stage = group_cache, tuple(group), stage
        self.pg = group_cache.get(self.group)
        self.size, self.index = len(group), list(group).index(group_cache.rank)
        owned = [(p, slot) for p, slot in trainable if zero_owns(slot, self.group)]
        if order:
            first = {path: k for k, path in enumerate(order)}
            owned.sort(key=lambda ps: first.get(ps[1].path, len(first)))
        self.owned = [p for p, _ in owned]
        self.replicas = [slot.replicas for _, slot in owned]
        self._owned_ids = {id(p): i for i, p in enumerate(self.owned)}
        keys = [unit_key(slot.path) for _, slot in owned] if stage == 3 else [""] * len(owned)
        self.layout = _Units(self.owned, keys, self.size, device=group_cache.device,
                             budget=UNIT_BYTES if stage == 3 else math.inf)  # 1–2: one unit
        self.flat: torch.Tensor | None = None
        """Stages 1–2 with pieces in the master's dtype: the buffer the pieces are views of."""
        if stage < 3 and self.owned and all(p.dtype == self.layout.dtype for p in self.owned):
            self.flat = self.layout.flat(0, [p.detach() for p in self.owned], device=self.owned[0].device)
            for p, view in zip(self.owned, self.layout.pieces(0, self.flat)):
                p.data = view
            cols = self.layout.cols[0]
            self.master = self.flat[self.index * cols:(self.index + 1) * cols].requires_grad_(True)
        else:
            rows = self.layout.to_rows([p.detach() for p in self.owned])
            self.master = rows[self.index].clone().requires_grad_(True)
        self.inner = factory([self.master])
        self.dtypes = [p.dtype for p in self.owned]
        self._segments = self.layout.segments(self.index)
        self._grads: torch.Tensor | None = None
        """Stages 1–2: this step's gradients of the owned pieces, laid out as the unit's flat
        buffer (so its rows are the reduce's input); made at the step's first gradient,
        released once summed."""
        self._filled: set[int] = set()
        """Owned pieces whose gradient is in ``_grads`` this step."""
        if stage < 3 and self.owned:
            me = weakref.ref(self)  # the pieces' hooks must not keep this optimizer alive

            def take(i: int, p: torch.Tensor) -> None:
                opt = me()
                if opt is not None:
                    opt._take_grad(i, p)

            for i, p in enumerate(self.owned):
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(functools.partial(take, i))
        self.stage3 = None
        if stage == 3:
            from torchweave.runtime.zero3 import Stage3

            self.stage3 = Stage3(self)
            for p in self.owned:  # the pieces themselves are no longer kept
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def owns(self, p: torch.Tensor) -> bool:
        return id(p) in self._owned_ids

    # ------------------------------------------------------------ forward
    def view(self, params: dict[str, torch.Tensor], cast: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        if self.stage3 is None:
            return {k: cast(v) for k, v in params.items()}
        return self.stage3.begin_forward(params, cast)

    def packer(self) -> Any:
        """Stage 3's rule for saved tensors: a gathered piece is saved as a place in its unit
        and gathered again in backward (:func:`torchweave.runtime.regather.forward_hooks`)."""
        assert self.stage3 is not None
        return self.stage3

    def end_forward(self) -> None:
        if self.stage3 is not None:
            self.stage3.end_forward()

    # ------------------------------------------------------------ gradients and step
    def _take_grad(self, i: int, p: torch.Tensor) -> None:
        """Stages 1–2: move piece ``i``'s gradient into its place in ``_grads`` (added to what an
        earlier backward of this step put there), and drop it from the piece, so the full
        gradients are held once, not as every piece's ``.grad`` and again as the reduce's
        input. A hook after each gradient's accumulation (the autograd engine's), and
        :meth:`finish_grads` for gradients set by hand (zero-bubble's weight passes)."""
        g = p.grad
        if g is None:
            return
        if self._grads is None:  # not zeroed: a piece with no gradient is zeroed at the end
            self._grads = self._empty_grads(g.device)
        o, n = self.layout.offsets[i], self.layout.numels[i]
        dst = self._grads[o:o + n].view(self.layout.shapes[i])
        if i in self._filled:
            dst.add_(g)
        else:
            dst.copy_(g)
            self._filled.add(i)
        p.grad = None

    @property
    def pending_grads(self) -> torch.Tensor | None:
        """Stages 1–2: this step's gradients not yet summed (None between steps)."""
        return self._grads

    def _empty_grads(self, device: torch.device) -> torch.Tensor:
        """The flat gradient buffer, uninitialised (what no gradient fills is zeroed at the end)."""
        return torch.empty(self.layout.cols[0] * self.size, dtype=self.layout.dtype, device=device)

    def drop_grads(self) -> None:
        """Forget this step's gradients (the master shard's too)."""
        self._grads, self._filled = None, set()
        self.master.grad = None

    def _grad_rows(self) -> torch.Tensor:
        """Stages 1–2: this step's gradients as ``[group, C]``, from ``_grads``."""
        for i, p in enumerate(self.owned):
            self._take_grad(i, p)
        if self._grads is None:
            self._grads = self._empty_grads(self.master.device)
        for i in range(len(self.owned)):
            if i not in self._filled:
                o = self.layout.offsets[i]
                self._grads[o:o + self.layout.numels[i]].zero_()
        last = len(self.owned) - 1
        self._grads[self.layout.offsets[last] + self.layout.numels[last]:].zero_()  # padding
        rows = self._grads.view(self.size, self.layout.total)
        self._grads, self._filled = None, set()
        return rows

    def finish_grads(self) -> None:
        if self.stage3 is not None:
            self.stage3.finish_grads()  # waits for the reduce-scatters backward started
            return
        if self.owned:
            rows = self._grad_rows()
        else:
            rows = self.layout.to_rows([])
        nbytes = rows.numel() * rows.element_size()
        if self.stage == 1:
            self.group_cache.counter.record(CommKind.ALL_REDUCE, Direction.BACKWARD, self.group, nbytes)
            dist.all_reduce(rows, group=self.pg)
            mine = rows[self.index].clone()
        else:
            self.group_cache.counter.record(CommKind.REDUCE_SCATTER, Direction.BACKWARD, self.group, nbytes)
            mine = torch.empty(self.layout.total, dtype=rows.dtype, device=rows.device)
            reduce_scatter_single(mine, rows.reshape(-1).contiguous(), group=self.pg)
        if self.master.grad is None:
            self.master.grad = mine
        else:  # a second backward before the step (the user's own loop) adds to the first
            self.master.grad.add_(mine)

    def grad_sq_norm(self) -> torch.Tensor:
        """This member's share of the squared global norm (the caller sums over the world)."""
        g = self.master.grad
        sq = torch.zeros((), dtype=torch.float64, device=self.master.device)
        if g is None:
            return sq
        weights = {self.size / r for r in self.replicas}
        if len(weights) == 1:  # padding holds zero gradients: sum the whole row
            return sq + g.double().pow(2).sum() * weights.pop()
        for a, b, i in self._segments:
            sq += g[a:b].double().pow(2).sum() * (self.size / self.replicas[i])
        return sq

    def scale_grads(self, factor: float) -> None:
        if self.master.grad is not None:
            self.master.grad.mul_(factor)

    def step(self, zero_grad: bool = True) -> None:
        self.inner.step()
        if zero_grad:
            self.inner.zero_grad(set_to_none=True)
        if self.stage == 3:
            return
        if self.flat is not None:  # into the pieces' own buffer (from a copy of this shard)
            self._gather_into(self.flat, self.master.detach().clone())
            return
        rows = self._gather_rows(self.master.detach())
        with torch.no_grad():
            for p, full in zip(self.owned, self.layout.from_rows(rows)):
                p.copy_(full)

    def _gather_rows(self, chunk: torch.Tensor) -> torch.Tensor:
        """Every member's ``[C]`` row → ``[group, C]``."""
        flat = torch.empty(self.size * self.layout.total, dtype=chunk.dtype, device=chunk.device)
        self._gather_into(flat, chunk)
        return flat.view(self.size, self.layout.total)

    def _gather_into(self, flat: torch.Tensor, chunk: torch.Tensor) -> None:
        self.group_cache.counter.record(CommKind.ALL_GATHER, Direction.FORWARD, self.group,
                               flat.numel() * flat.element_size())
        all_gather_single(flat, chunk.contiguous(), group=self.pg)

    def load_pieces(self, params: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
        """Set the owned pieces (path → new value; absent ones keep theirs) and their master shard."""
        paths = {id(p): path for path, p in params.items()}
        owned = [paths[id(p)] for p in self.owned]
        if any(path not in values for path in owned):
            current = self.full_params(params)
            values = {**{path: current[path] for path in owned}, **values}
        rows = self.layout.to_rows([values[path].to(self.master.device) for path in owned])
        with torch.no_grad():
            self.master.copy_(rows[self.index])
            if self.stage < 3:
                for p, path in zip(self.owned, owned):
                    p.copy_(values[path])

    def load_state(self, params: dict[str, torch.Tensor], values: dict[str, torch.Tensor],
                   state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Set the master shard from every owned piece's value (path → piece) and the inner
        optimizer's state from each piece's own (path → name → piece; a 0-dim entry, such as
        AdamW's ``step``, is one count shared by the shard). A piece without state adds zeros."""
        self.load_pieces(params, values)
        paths = {id(p): path for path, p in params.items()}
        owned = [paths[id(p)] for p in self.owned]
        inner: dict[str, torch.Tensor] = {}
        for name in sorted({k for path in owned for k in state.get(path, {})}):
            per = [state.get(path, {}).get(name) for path in owned]
            counts = [v for v in per if v is not None and not v.dim()]
            if counts:
                inner[name] = counts[0].clone()
                continue
            dtype = next(v.dtype for v in per if v is not None)
            pieces = [v.to(self.master.device) if v is not None else
                      torch.zeros(self.layout.shapes[i], device=self.master.device)
                      for i, v in enumerate(per)]
            inner[name] = self.layout.to_rows(pieces)[self.index].to(dtype).clone()
        if inner:
            self.inner.state[self.master] = inner

    # ------------------------------------------------------------ inspection
    def full_params(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.stage < 3:
            return params
        fulls = self.layout.from_rows(self._gather_rows(self.master.detach()))
        return {path: fulls[self._owned_ids[id(p)]].to(p.dtype) if self.owns(p) else p
                for path, p in params.items()}

    def full_grads(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        """Gradients of every piece (owned ones gathered from their shards)."""
        grad = self.master.grad if self.master.grad is not None else torch.zeros_like(self.master)
        rows = self._gather_rows(grad)  # no gradient yet (or nothing owned, at one rank): zeros
        fulls = self.layout.from_rows(rows)
        return {path: fulls[self._owned_ids[id(p)]] if self.owns(p) else p.grad
                for path, p in params.items()}
