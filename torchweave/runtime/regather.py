"""Gathered activations kept for backward as their shard, and gathered again there.

Sequence parallelism all-gathers a layer's input along the sequence before a
tensor-parallel matmul, and the matmul saves that whole input for its weight
gradient. Kept as autograd keeps it, every rank would hold the full input of
each such layer from forward to backward: ``tp`` times what it holds of the
sequence. Megatron-LM keeps the shard instead and gathers again in backward.
So does torchweave, for each forward all-gather that lowering marks
``regather`` (:class:`torchweave.lower.steps.AllGather`):

- while a forward runs under :func:`forward_hooks`, ``C.all_gather(...,
  regather=True)`` notes its output, the shard it was made from and the group;
- a tensor autograd then saves that is the output, or a view of it, is saved as
  that note plus where the view lies in the output;
- in backward, the first read of a saved view gathers the output again (the
  same bytes: gathering is concatenation), later reads reuse that gather, and
  the read that matches the last save drops it;
- that first read also starts gathering, asynchronously, the output noted
  before it on the same group in the same forward (the next one backward
  reads), so the gather overlaps the backward in between: two gathered
  outputs are alive at most, as in ZeRO-3's backward prefetch;
- each group's last saved output is gathered ahead too, from the moment the
  forward's backward starts (:meth:`Forward.prefetch`: when backward reaches
  the forward's loss or, in a pipeline, when the stage's backward action
  begins).

The chains are per group, so every member of a group issues its gathers at the
same points of its own backward. The runtime's other saving rule, ZeRO-3's (a
gathered parameter is saved as a place in its unit), composes with this one
through :func:`forward_hooks`: autograd applies only the innermost hooks, so
both share one pair.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Hashable, Iterator, Protocol

import torch


class Packer(Protocol):
    """One rule for saving tensors: ``pack`` returns what to keep instead, or None."""

    def pack(self, t: torch.Tensor) -> Any | None: ...

    def unpack(self, data: Any) -> torch.Tensor: ...


class _Noted:
    """A gathered output: how to make it again, and its reads in the current backward."""

    __slots__ = ("ref", "shard", "start", "before", "saves", "reads", "done", "full",
                 "pending", "__weakref__")

    def __init__(self, ref: weakref.ref, shard: torch.Tensor,
                 start: Callable[[torch.Tensor], Callable[[], torch.Tensor]],
                 before: "_Noted | None") -> None:
        self.ref, self.shard, self.start = ref, shard, start
        self.before = weakref.ref(before) if before is not None else None
        """The output noted just before this one on the same group in the same forward."""
        self.saves = self.reads = 0
        self.done = False
        """Every saved view was read once: backward is past it."""
        self.full: torch.Tensor | None = None
        self.pending: Callable[[], torch.Tensor] | None = None
        """A gather started ahead of the first read: waits for it and gives the result."""

    def prefetch(self) -> None:
        if self.full is None and self.pending is None:
            self.pending = self.start(self.shard)


def _saved_before(hit: _Noted) -> _Noted | None:
    """The nearest output noted before ``hit`` on its group that autograd saved and backward
    has not passed."""
    ref = hit.before
    while ref is not None:
        prev = ref()
        if prev is None:
            return None
        if prev.saves and not prev.done:
            return prev
        ref = prev.before
    return None


class Forward:
    """One forward's notes: where its backward starts gathering."""

    def __init__(self) -> None:
        self.last: dict[Hashable, _Noted] = {}
        """Per group: the last output noted."""

    def prefetch(self, *_: Any) -> None:
        """Start gathering, per group (in a fixed order), the last output this forward saved:
        its backward reads it first."""
        for group in sorted(self.last):
            last = self.last[group]
            if not last.saves or last.done:
                last = _saved_before(last)
            if last is not None:
                last.prefetch()

    def at_backward(self, t: Any) -> None:
        """Prefetch once backward reaches ``t`` (the forward's loss)."""
        if self.last and isinstance(t, torch.Tensor) and t.grad_fn is not None:
            t.grad_fn.register_prehook(self.prefetch)


class Regather:
    """The rule above, for this process (one rank's program runs in each)."""

    def __init__(self) -> None:
        self._noted: dict[int, _Noted] = {}
        self._depth = 0
        self._last: dict[Hashable, _Noted] = {}
        self.saved = 0
        """How many saved tensors were kept as a shard (read by tests)."""

    @contextlib.contextmanager
    def noting(self) -> Iterator[Forward]:
        """One forward: outputs gathered with ``regather`` are noted."""
        self._depth += 1
        outer, self._last = self._last, {}
        call = Forward()
        try:
            yield call
        finally:
            call.last = self._last
            self._depth -= 1
            self._last = outer

    def note(self, full: torch.Tensor, shard: torch.Tensor, group: Hashable,
             start: Callable[[torch.Tensor], Callable[[], torch.Tensor]]) -> None:
        """``full`` is what ``start(shard)()`` gives again over ``group``: save it as the
        shard while a forward notes."""
        if not self._depth or not full.numel():
            return
        key = full.untyped_storage().data_ptr()  # a saved view shares the storage
        noted = self._noted

        def gone(_ref: weakref.ref, key: int = key) -> None:
            noted.pop(key, None)

        base = full._base if full._base is not None else full  # alive while any view is
        noted[key] = self._last[group] = _Noted(weakref.ref(base, gone), shard, start,
                                                self._last.get(group))

    def pack(self, t: torch.Tensor) -> Any | None:
        if not self._noted or t.layout is not torch.strided or not t.numel():
            return None
        # while a noted output lives, no other storage has its address (a dead one's
        # note is gone: ``note``'s callback)
        hit = self._noted.get(t.untyped_storage().data_ptr())
        if hit is None or hit.ref() is None:
            return None
        hit.saves += 1
        self.saved += 1
        return hit, t.storage_offset(), tuple(t.shape), t.stride()

    def unpack(self, data: Any) -> torch.Tensor:
        hit, offset, shape, stride = data
        if hit.full is None:
            hit.prefetch()
            hit.full, hit.pending = hit.pending(), None
            nxt = _saved_before(hit)
            if nxt is not None:  # what backward reads next on this group: start it now
                nxt.prefetch()
        out = hit.full.as_strided(shape, stride, offset)
        hit.reads += 1
        if hit.reads >= hit.saves:  # the last saved view is read: drop the gather
            hit.full, hit.reads, hit.done = None, 0, True
        return out


REGATHER = Regather()


class _Packed:
    __slots__ = ("owner", "data")

    def __init__(self, owner: Packer, data: Any) -> None:
        self.owner, self.data = owner, data


def saved_tensor_hooks(*packers: Packer) -> Any:
    """One pair of autograd hooks applying ``packers`` in turn (the first that takes a tensor)."""
    def pack(t: torch.Tensor) -> Any:
        for p in packers:
            data = p.pack(t)
            if data is not None:
                return _Packed(p, data)
        return t

    def unpack(x: Any) -> torch.Tensor:
        return x.owner.unpack(x.data) if type(x) is _Packed else x

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


@contextlib.contextmanager
def forward_hooks(regather: bool, *others: Packer) -> Iterator[Forward]:
    """The saving rules of one forward: regathered activations (when ``regather``) and
    ``others`` (ZeRO-3's); nothing at all when there is no rule. Gives the forward's
    :class:`Forward` (empty without ``regather``)."""
    packers = ([REGATHER] if regather else []) + list(others)
    if not packers:
        yield Forward()
        return
    with contextlib.ExitStack() as stack:
        call = stack.enter_context(REGATHER.noting()) if regather else Forward()
        stack.enter_context(saved_tensor_hooks(*packers))
        yield call
