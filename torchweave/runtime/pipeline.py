"""Run one rank of a pipelined plan: walk its schedule row, one action at a time.

- ``F`` (stage ``s``, micro-batch ``m``): receive the stage's inputs, run the
  generated ``stage{s}`` on micro-batch ``m`` keeping its autograd graph, send
  its outputs. Sends are posted (``isend``) and never waited on until the end
  of the step, so the runtime keeps the dry run's promise that a send never
  blocks; every message is tagged by (boundary, micro-batch, direction,
  transfer), so a receive takes exactly the message it waits for.
- ``B``: receive the gradients of what ``F`` sent, run backward from them (and
  from the loss term on the last stage), send the gradients of what ``F``
  received.
- ``I`` then ``W`` (zero-bubble): ``I`` runs backward to the stage's inputs
  only and sends their gradients; ``W`` later computes the parameters'
  gradients from what ``I`` kept at the ops that read them
  (:mod:`torchweave.runtime.zb`).
- ``R`` (multi-forward, pass ``k``): as ``F`` but under ``torch.no_grad()``,
  keeping nothing; the last stage sends the recycled outputs back to stage 0,
  which reads them as inputs on pass ``k + 1`` (an ``R``, or the ``F``).
  Messages of different passes have different tags.

Gradient sync overlaps the schedule's tail: a replicated parameter's
gradient is final after the last ``B`` or ``W`` of every stage on this rank
that reads it, and its bucket's all-reduce starts then (during that backward,
from the gradient hooks, or right after the action for gradients accumulated
by hand, as ``W`` does), while the rank goes on with its other actions. ZeRO
shards the gradients after the last action; clipping and the optimizer step
follow, all as in :class:`~torchweave.runtime.executor.RankModule`, which this
class extends.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from torchweave.errors import Problem, TorchweaveError
from torchweave.lower.program import Boundary, RecycleLink, Segment
from torchweave.lower.stages import reads
from torchweave.plan.schedules import Action, Kind
from torchweave.runtime.counter import CommKind, Direction
from torchweave.runtime.executor import RankModule
from torchweave.runtime.zb import SplitBackward

_FWD, _BWD = 0, 1
_TAG_TRANSFERS = 4096
"""Room for this many transfers per boundary in a message tag."""


def _region(t: torch.Tensor, box) -> torch.Tensor:
    return t[tuple(slice(a, b) for a, b in box)]


def _shape(box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


@dataclass
class _Live:
    """One (stage, micro-batch) between its F and its backward."""

    loss: torch.Tensor | None
    outputs: dict[str, torch.Tensor]
    leaves: dict[str, torch.Tensor]
    """Received and handed-over inputs: leaves whose gradients go back."""
    tokens: list[torch.Tensor] = field(default_factory=list)
    roots: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    split: SplitBackward | None = None


@dataclass
class StepStats:
    """What this rank's last step did, for measuring bubbles and memory."""

    wall_s: float = 0.0
    """From the first action to the end of the last (sends completed)."""
    wait_s: float = 0.0
    """Time blocked in receives: idle, waiting for another stage."""
    peak_live: int = 0
    """Most (stage, micro-batch) pairs between their F and their last backward action."""
    early_buckets: int = 0
    """Gradient buckets whose sum started before this rank's last action (overlapped with compute)."""


class PipelineModule(RankModule):
    """One rank of a pipelined plan, with ``train_step(*batch)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        prog = self.program
        if self.config.grad_accum != 1:
            raise TorchweaveError(Problem(
                obj="StepConfig.grad_accum", value=str(self.config.grad_accum),
                rule="a pipelined plan takes its micro-batches from the plan",
                fix=f"set grad_accum=1 (the plan runs {prog.micro_batches} micro-batches)"))
        self.sync.enabled = False  # only while an action runs that makes gradients final
        self.segments: dict[int, Segment] = {seg.stage: seg for seg in prog.segments}
        self.fns = {s: getattr(self.code, f"stage{s}") for s in self.segments}
        self.micro = prog.micro_batches
        self.passes = prog.passes
        self.stats = StepStats()
        self._final = self._final_grads()
        self._final_ids = [{id(p) for p in ps} for ps in self._final]

    def _final_grads(self) -> list[list[torch.Tensor]]:
        """Per action of this rank: the parameter pieces whose gradient is complete once it ran.

        A piece is final after the last ``B`` or ``W`` of every stage (on this
        rank) whose code reads it; one that no stage reads, after the first action.
        """
        local = {slot.local: self.params[slot.path] for slot in self.program.params if slot.path in self.params}
        last = {a.stage: i for i, a in enumerate(self.program.actions) if a.kind in (Kind.B, Kind.W)}
        done: dict[int, int] = {}  # id of a piece -> index of the action after which it is final
        for s, seg in self.segments.items():
            for name in {n for ins in seg.instrs for n in reads(ins) if n in local}:
                done[id(local[name])] = max(done.get(id(local[name]), 0), last.get(s, 0))
        final: list[list[torch.Tensor]] = [[] for _ in self.program.actions]
        if final:
            for p, _ in self.trainable:
                final[done.get(id(p), 0)].append(p)
        return final

    # ------------------------------------------------------------ one step
    def backward_step(self, *batch: torch.Tensor) -> float:
        inputs = [self._cast(x.to(self.rt.device)) if isinstance(x, torch.Tensor) else x for x in batch]
        self._micro = [torch.chunk(x, self.micro, dim=0) for x in inputs]
        self._params = self.param_view()
        self._live: dict[tuple[int, int], _Live] = {}
        self._handed: dict[tuple[str, int], torch.Tensor] = {}
        self._handed_grad: dict[tuple[str, int], torch.Tensor] = {}
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._to_self: dict[int, torch.Tensor] = {}
        self._loss = 0.0
        self.stats = StepStats()
        start = time.perf_counter()
        for i, action in enumerate(self.program.actions):
            final = self._final[i]
            if i == len(self.program.actions) - 1:
                self.stats.early_buckets = self.sync.started
            if self.sync.overlap:
                self.sync.enabled, self.sync.allow = bool(final), self._final_ids[i]
            self.run(action)
            self.sync.mark_ready(final)
            self.stats.peak_live = max(self.stats.peak_live, len(self._live))
            self._drop_sent()
        self.sync.enabled = False
        for work, _ in self._pending:
            work.wait()
        self._pending = []
        self.stats.wall_s = time.perf_counter() - start
        self.sync.finish()
        if self.opt is not None:
            self.opt.finish_grads()
        if self.config.clip_grad_norm is not None:
            self.clip(self.config.clip_grad_norm)
        return self._reported_loss()

    def run(self, a: Action) -> None:
        if a.kind is Kind.F:
            self._forward(a.stage, a.micro, self.passes - 1)
        elif a.kind is Kind.R:
            self._forward(a.stage, a.micro, a.iteration)
        elif a.kind is Kind.B:
            self._backward(a.stage, a.micro, to_inputs=True, to_params=True)
        elif a.kind is Kind.I:
            self._backward(a.stage, a.micro, to_inputs=True, to_params=False)
        elif a.kind is Kind.W:
            self._backward(a.stage, a.micro, to_inputs=False, to_params=True)

    def _forward(self, s: int, m: int, k: int) -> None:
        """Pass ``k`` of stage ``s`` on micro-batch ``m``: with gradients on the last pass."""
        grad = k == self.passes - 1
        seg = self.segments[s]
        b: dict[str, torch.Tensor] = {}
        for bd in seg.recvs:
            b[bd.key] = self._recv(bd, m, k)
        for name in seg.inputs:
            src = self._handed.pop((name, m, k))
            b[name] = src.detach().requires_grad_(src.requires_grad) if grad else src
        self.rt.tokens = []
        inputs = [x[m] for x in self._micro]
        if k > 0 and s == 0:
            for link in self.program.recycle:
                if self.rt.rank in dict(link.boxes):
                    inputs[link.index] = self._recv_recycled(link, m, k)
        with contextlib.nullcontext() if grad else torch.no_grad():
            loss, outputs = self.fns[s](self.rt, self._params, *inputs, b)
        if grad:
            self._live[(s, m)] = _Live(loss, outputs, b, list(self.rt.tokens))
        for bd in seg.sends:
            self._send(bd, outputs[bd.local], m, k)
        for name in seg.outputs:
            if self._read_locally(name):
                self._handed[(name, m, k)] = outputs[name]
        if not grad:
            for link in self.program.recycle:
                if link.output in outputs:
                    self._send_recycled(link, outputs[link.output], m, k)
        elif loss is not None:
            self._loss += float(loss.detach()) / self.micro

    def _read_locally(self, name: str) -> bool:
        return any(name in seg.inputs for seg in self.segments.values())

    def _backward(self, s: int, m: int, *, to_inputs: bool, to_params: bool) -> None:
        seg, live = self.segments[s], self._live[(s, m)]
        if to_inputs:  # B or I: collect the roots once
            roots, grads = live.roots, live.grads
            if live.loss is not None and live.loss.requires_grad:
                roots.append(live.loss.float() / self.micro)
                grads.append(torch.ones_like(roots[-1]))
            for t in live.tokens:
                roots.append(t)
                grads.append(torch.ones_like(t) if t.numel() else torch.zeros_like(t))
            for bd in seg.sends:
                g = self._recv_grad(bd, live.outputs[bd.local], m)
                if g is not None and live.outputs[bd.local].requires_grad:
                    roots.append(live.outputs[bd.local])
                    grads.append(g)
            for name in seg.outputs:
                g = self._handed_grad.pop((name, m), None)
                if g is not None and live.outputs[name].requires_grad:
                    roots.append(live.outputs[name])
                    grads.append(g)
        leaves = [t for t in live.leaves.values() if t.requires_grad]
        if to_inputs and to_params:
            if live.roots:
                torch.autograd.backward(live.roots, live.grads)
        elif to_inputs:  # I: input gradients now, weight gradients kept for W
            live.split = SplitBackward(live.roots, live.grads, leaves, [p for p, _ in self.trainable])
        elif live.split is not None:
            live.split.weights()
        if to_inputs:
            for bd in seg.recvs:
                leaf = live.leaves[bd.key]
                if bd.grad:
                    self._send_grad(bd, leaf.grad if leaf.grad is not None else torch.zeros_like(leaf), m)
            for name in seg.inputs:
                leaf = live.leaves[name]
                if leaf.grad is not None:
                    key = (name, m)
                    prev = self._handed_grad.get(key)
                    self._handed_grad[key] = leaf.grad if prev is None else prev + leaf.grad
        if to_params:
            del self._live[(s, m)]

    # ------------------------------------------------------------ messages
    def _tag(self, index: int, m: int, direction: int, j: int, k: int | None = None) -> int:
        """Message ``j`` of boundary ``index`` (recycle links follow the boundaries) for
        micro-batch ``m``, pass ``k`` (default: the last, with gradients)."""
        k = self.passes - 1 if k is None else k
        return (((index * self.micro + m) * 2 + direction) * self.passes + k) * _TAG_TRANSFERS + j

    def _post(self, data: torch.Tensor, dst: int, tag: int, direction: Direction) -> None:
        data = data.detach().contiguous()
        if dst == self.rt.rank:  # a rank that holds part of what it receives
            self._to_self[tag] = data
            return
        self.rt.gc.counter.record(CommKind.P2P, direction, (self.rt.rank, dst),
                                  data.numel() * data.element_size())
        self._pending.append((dist.isend(data, dst, tag=tag), data))

    def _drop_sent(self) -> None:
        """Free the buffers of sends that have completed (the rest are waited on at the end)."""
        left = []
        for work, data in self._pending:
            if work.is_completed():
                work.wait()  # raises if the send failed
            else:
                left.append((work, data))
        self._pending = left

    def _wait_for(self, buf: torch.Tensor, src: int, tag: int) -> None:
        if src == self.rt.rank:
            buf.copy_(self._to_self.pop(tag))
            return
        start = time.perf_counter()
        dist.recv(buf, src, tag=tag)
        self.stats.wait_s += time.perf_counter() - start

    def _recv_into(self, out: torch.Tensor, transfers, index: int, m: int, k: int) -> None:
        """Receive this rank's transfers of ``index`` into ``out`` (boxes in its coordinates)."""
        for j, t in enumerate(transfers):
            if t.dst != self.rt.rank:
                continue
            piece = torch.empty(_shape(t.dst_box), dtype=out.dtype, device=out.device)
            self._wait_for(piece, t.src, self._tag(index, m, _FWD, j, k))
            target = _region(out, t.dst_box)
            target.add_(piece) if t.add else target.copy_(piece)

    def _send_from(self, x: torch.Tensor, transfers, index: int, m: int, k: int) -> None:
        for j, t in enumerate(transfers):
            if t.src == self.rt.rank:
                self._post(_region(x, t.src_box), t.dst, self._tag(index, m, _FWD, j, k),
                           Direction.FORWARD)

    def _recv(self, bd: Boundary, m: int, k: int) -> torch.Tensor:
        dtype = getattr(torch, bd.dtype.removeprefix("torch."))
        out = torch.zeros(dict(bd.step.shapes)[self.rt.rank], dtype=dtype, device=self.rt.device)
        self._recv_into(out, bd.step.transfers, bd.index, m, k)
        if bd.grad and dtype.is_floating_point and k == self.passes - 1:
            out.requires_grad_(True)
        return out

    def _send(self, bd: Boundary, x: torch.Tensor, m: int, k: int) -> None:
        self._send_from(x, bd.step.transfers, bd.index, m, k)

    def _link_index(self, link: RecycleLink) -> int:
        return self.program.boundaries + self.program.recycle.index(link)

    def _send_recycled(self, link: RecycleLink, x: torch.Tensor, m: int, k: int) -> None:
        """The last stage's output of pass ``k``, to the devices that read it on pass ``k + 1``."""
        self._send_from(x, link.step.transfers, self._link_index(link), m, k)

    def _recv_recycled(self, link: RecycleLink, m: int, k: int) -> torch.Tensor:
        """Pass ``k``'s recycled input: the whole input, this rank's region filled from pass ``k - 1``."""
        out = torch.zeros_like(self._micro[link.index][m])
        self._recv_into(_region(out, dict(link.boxes)[self.rt.rank]), link.step.transfers,
                        self._link_index(link), m, k - 1)
        return out

    def _send_grad(self, bd: Boundary, g: torch.Tensor, m: int) -> None:
        scale = dict(bd.step.grad_scale).get(self.rt.rank, 1.0)
        if scale != 1.0:
            g = g * scale
        for j, t in enumerate(bd.step.grad_back):
            if t.src == self.rt.rank:
                self._post(_region(g, t.src_box), t.dst, self._tag(bd.index, m, _BWD, j), Direction.BACKWARD)

    def _recv_grad(self, bd: Boundary, x: torch.Tensor, m: int) -> torch.Tensor | None:
        if not bd.grad:
            return None
        holder = torch.zeros_like(x, memory_format=torch.contiguous_format)
        for j, t in enumerate(bd.step.grad_back):
            if t.dst != self.rt.rank:
                continue
            piece = torch.empty(_shape(t.dst_box), dtype=x.dtype, device=x.device)
            self._wait_for(piece, t.src, self._tag(bd.index, m, _BWD, j))
            _region(holder, t.dst_box).add_(piece)
        return holder

    # ------------------------------------------------------------ loss
    def _reported_loss(self) -> float:
        """The step's loss on every rank: each partial term counted once, from the last stage."""
        prog, world = self.program, self.program.world_size
        if world == 1:
            return self._loss
        buf = torch.zeros(2 * world, dtype=torch.float64, device=self.rt.device)
        if prog.loss is not None:
            index = prog.loss_partial[0]
            buf[index] = self._loss
            buf[world + index] = 1.0
        dist.all_reduce(buf)
        counts = buf[world:]
        return float((buf[:world][counts > 0] / counts[counts > 0]).sum())
