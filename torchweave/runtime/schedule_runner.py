"""Run one rank of a pipelined plan: walk its schedule row, one action at a time.

- ``F`` (stage ``s``, micro-batch ``m``): receive the stage's inputs, run the
  generated ``stage{s}`` on micro-batch ``m`` keeping its autograd graph, send
  its outputs. Sends are posted (``isend``) and never waited on until the end
  of the step, so the runtime keeps the dry run's promise that a send never
  blocks.
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

Every message is issued from the program's ``messages``
(:mod:`torchweave.lower.messages`): before an action the rank waits for its
receives, posted in the order each sender sends (``irecv``, before the action
ahead of it computed, so that they arrive meanwhile), keeping those meant for
later actions; after it, its sends in one fixed order. So each pair of ranks
issues its messages in one order, which the dry run checked, and tags are
not needed (NCCL ignores them): ``StepConfig.p2p_tags`` sends every message
with tag 0 (``untagged``, the default on NCCL) or tags each by (link,
micro-batch, direction, pass, transfer) (``tagged``, the default on gloo,
where a message out of order then waits instead of landing in the wrong
tensor). Pipeline messages go over their own process groups, one per
direction (to a higher rank, to a lower one), apart from the point-to-point
exchanges inside a stage.

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

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from torchweave.errors import Problem, TorchweaveError
from torchweave.lower.messages import links
from torchweave.lower.program import Exchange, Message, Segment
from torchweave.lower.stages import reads
from torchweave.lower.steps import Transfer
from torchweave.plan.schedules import Action, Kind
from torchweave.runtime.counter import CommKind, Direction
from torchweave.runtime.executor import RankModule
from torchweave.runtime.loss_messages import LossMessages
from torchweave.runtime.regather import Forward, forward_hooks
from torchweave.runtime.zb import SplitBackward

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
    send_roots: list[torch.Tensor] = field(default_factory=list)
    roots: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    split: SplitBackward | None = None
    regather: Forward = field(default_factory=Forward)
    """Its forward's regathered activations (runtime/regather.py)."""


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


def _tagged(mode: str, group_cache) -> bool:
    """``auto``: tags on gloo (a mismatch then waits instead of swapping tensors), none on NCCL."""
    if mode == "auto":
        return group_cache.world_size > 1 and not group_cache.nccl
    return mode == "tagged"


class PipelineModule(RankModule):
    """One rank of a pipelined plan, with ``train_step(*batch)``."""

    loss_rides = False  # only the last stage has the loss: it goes by message (loss_messages)

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
        self._links = links(prog)
        self._dtype = {bd.index: getattr(torch, bd.dtype.removeprefix("torch."))
                       for seg in prog.segments for bd in seg.recvs + seg.sends}
        self.tagged = _tagged(self.config.p2p_tags, self.rt.group_cache)
        """Messages carry tags (a check on gloo); untagged, each is sent with tag 0."""
        self._groups = self.rt.group_cache.pipeline_groups()
        self.loss_messages = LossMessages.build(self.program, self.rt.group_cache)
        """The loss's terms sent to every rank (:mod:`~torchweave.runtime.loss_messages`); None:
        summed by an all-reduce after the step."""
        self._final = self._final_grads()
        self._final_ids = [{id(p) for p in ps} for ps in self._final]

    def _final_grads(self) -> list[list[torch.Tensor]]:
        """Per action of this rank: the parameter pieces whose gradient is complete once it ran.

        A piece is final after the last ``B`` or ``W`` of every stage (on this
        rank) whose code reads it; one that no stage reads, after the first action. A tied
        weight's copy (``ParamSlot.copied``) is in none: its sum, over other stage groups,
        starts in ``GradSync.finish`` once this rank's sends are done, so that no collective
        across stages waits on a transfer this rank has yet to make (its bucket is the last
        one: the weight is the first a stage reads)."""
        local = {slot.local: self.params[slot.path] for slot in self.program.params if slot.path in self.params}
        last = {a.stage: i for i, a in enumerate(self.program.actions) if a.kind in (Kind.B, Kind.W)}
        done: dict[int, int] = {}  # id of a piece -> index of the action after which it is final
        for s, seg in self.segments.items():
            for name in {n for ins in seg.instrs for n in reads(ins) if n in local}:
                done[id(local[name])] = max(done.get(id(local[name]), 0), last.get(s, 0))
        final: list[list[torch.Tensor]] = [[] for _ in self.program.actions]
        late = {id(self.params[slot.path]) for slot in self.program.params
                if slot.copied and slot.path in self.params}
        if final:
            for p, _ in self.trainable:
                if id(p) not in late:
                    final[done.get(id(p), 0)].append(p)
        return final

    # ------------------------------------------------------------ one step
    def backward_async(self, *batch: torch.Tensor) -> Callable[[], float]:
        inputs = [self._cast(x.to(self.rt.device)) if isinstance(x, torch.Tensor) else x for x in batch]
        self._micro = [torch.chunk(x, self.micro, dim=0) for x in inputs]
        self._params = self.param_view()
        self._live: dict[tuple[int, int], _Live] = {}
        self._handed: dict[tuple[str, int], torch.Tensor] = {}
        self._handed_grad: dict[tuple[str, int], torch.Tensor] = {}
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._got: dict[Message, torch.Tensor] = {}
        self._posted: dict[Message, tuple[Any, torch.Tensor]] = {}
        self._loss = 0.0
        self._loss_terms = 0
        if self.loss_messages is not None:
            self.loss_messages.begin()
        self.stats = StepStats()
        start = time.perf_counter()
        for i, action in enumerate(self.program.actions):
            final = self._final[i]
            if i == len(self.program.actions) - 1:
                self.stats.early_buckets = self.sync.started
            if self.sync.overlap:
                self.sync.enabled, self.sync.allow = bool(final), self._final_ids[i]
            self.run(action, self.program.messages[i],
                     self.program.messages[i + 1] if i + 1 < len(self.program.actions) else None)
            self.sync.mark_ready(final)
            self.stats.peak_live = max(self.stats.peak_live, len(self._live))
            self._drop_sent()
        self.sync.enabled = False
        if self.loss_messages is not None:  # once a step: here if no forward made it final
            self.loss_messages.send(self._loss)
        for work, _ in self._pending:
            work.wait()
        self._pending = []
        self.stats.wall_s = time.perf_counter() - start
        self.sync.finish()
        if self.zero_opt is not None:
            self.zero_opt.finish_grads()
        if self.config.clip_grad_norm is not None:
            self.clip(self.config.clip_grad_norm)
        return self._reported_loss()

    def run(self, a: Action, ex: Exchange, following: Exchange | None = None) -> None:
        """Run action ``a``; ``following``: the next action's exchange, whose receives are
        posted before ``a`` computes, so that they arrive meanwhile."""
        self._receive(ex)
        if following is not None:
            self._post(following)
        if a.kind is Kind.F:
            self._forward(a.stage, a.micro, self.passes - 1, ex)
        elif a.kind is Kind.R:
            self._forward(a.stage, a.micro, a.iteration, ex)
        elif a.kind is Kind.B:
            self._backward(a.stage, a.micro, ex, to_inputs=True, to_params=True)
        elif a.kind is Kind.I:
            self._backward(a.stage, a.micro, ex, to_inputs=True, to_params=False)
        elif a.kind is Kind.W:
            self._backward(a.stage, a.micro, ex, to_inputs=False, to_params=True)

    def _forward(self, s: int, m: int, k: int, ex: Exchange) -> None:
        """Pass ``k`` of stage ``s`` on micro-batch ``m``: with gradients on the last pass."""
        grad = k == self.passes - 1
        seg = self.segments[s]
        got: dict[int, torch.Tensor] = {}
        for bd in seg.recvs:
            got[bd.index] = torch.zeros(dict(bd.step.shapes)[self.rt.rank], dtype=self._dtype[bd.index],
                                        device=self.rt.device)
        inputs = [x[m] for x in self._micro]
        if k > 0 and s == 0:
            for i, link in enumerate(self.program.recycle):
                if self.rt.rank in dict(link.boxes):
                    inputs[link.index] = torch.zeros_like(inputs[link.index])
                    got[self.program.boundaries + i] = _region(inputs[link.index], dict(link.boxes)[self.rt.rank])
        self._take(ex.needs, got)
        b: dict[str, torch.Tensor] = {}
        for bd in seg.recvs:
            b[bd.key] = got[bd.index]
            if bd.grad and b[bd.key].is_floating_point() and grad:
                b[bd.key].requires_grad_(True)
        for name in seg.inputs:
            src = self._handed.pop((name, m, k))
            b[name] = src.detach().requires_grad_(src.requires_grad) if grad else src
        self.rt.send_roots = []
        if grad:
            with forward_hooks(self.regather) as call:
                loss, outputs = self.fns[s](self.rt, self._params, *inputs, b)
            self._live[(s, m)] = _Live(loss, outputs, b, list(self.rt.send_roots), regather=call)
        else:
            with torch.no_grad():
                loss, outputs = self.fns[s](self.rt, self._params, *inputs, b)
        values = {bd.index: outputs[bd.local] for bd in seg.sends}
        for i, link in enumerate(self.program.recycle):
            if not grad and link.output in outputs:
                values[self.program.boundaries + i] = outputs[link.output]
        self._send(ex, values)
        for name in seg.outputs:
            if self._read_locally(name):
                self._handed[(name, m, k)] = outputs[name]
        if grad and loss is not None:
            self._loss = self._loss + loss.detach().double() / self.micro
            self._loss_terms += 1
            if self._loss_terms == self.micro and self.loss_messages is not None:
                self.loss_messages.send(self._loss)

    def _read_locally(self, name: str) -> bool:
        return any(name in seg.inputs for seg in self.segments.values())

    def _backward(self, s: int, m: int, ex: Exchange, *, to_inputs: bool, to_params: bool) -> None:
        seg, live = self.segments[s], self._live[(s, m)]
        if to_inputs:  # B or I: collect the roots once
            live.regather.prefetch()  # before the stage's first read (runtime/regather.py)
            roots, grads = live.roots, live.grads
            if live.loss is not None and live.loss.requires_grad:
                roots.append(live.loss.float() / self.micro)
                grads.append(torch.ones_like(roots[-1]))
            for t in live.send_roots:
                roots.append(t)
                grads.append(torch.ones_like(t) if t.numel() else torch.zeros_like(t))
            got = {bd.index: torch.zeros_like(live.outputs[bd.local], memory_format=torch.contiguous_format)
                   for bd in seg.sends if bd.grad}
            self._take(ex.needs, got)
            for bd in seg.sends:
                if bd.grad and live.outputs[bd.local].requires_grad:
                    roots.append(live.outputs[bd.local])
                    grads.append(got[bd.index])
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
            values = {}
            for bd in seg.recvs:
                leaf = live.leaves[bd.key]
                if bd.grad:
                    g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                    scale = dict(bd.step.grad_scale).get(self.rt.rank, 1.0)
                    values[bd.index] = g * scale if scale != 1.0 else g
            self._send(ex, values)
            for name in seg.inputs:
                leaf = live.leaves[name]
                if leaf.grad is not None:
                    key = (name, m)
                    prev = self._handed_grad.get(key)
                    self._handed_grad[key] = leaf.grad if prev is None else prev + leaf.grad
        if to_params:
            del self._live[(s, m)]

    # ------------------------------------------------------------ messages
    def _tag(self, x: Message) -> int:
        """``x``'s tag (0 for every message when untagged): (link, micro-batch, direction,
        pass, transfer)."""
        if not self.tagged:
            return 0
        return ((((x.link * self.micro + x.micro) * 2 + x.grad) * self.passes + x.iteration)
                * _TAG_TRANSFERS + x.transfer)

    def _group(self, x: Message):
        """The pipeline's group for ``x``'s direction: one order per ordered pair of ranks."""
        return self._groups[0] if x.src < x.dst else self._groups[1]

    def _transfer(self, x: Message) -> Transfer:
        step = self._links[x.link]
        return (step.grad_back if x.grad else step.transfers)[x.transfer]

    def _post(self, ex: Exchange) -> None:
        """Post the action's receives not posted yet, in the order their senders send them
        (a rank's posts to one peer keep the order of the schedule's messages)."""
        for x in ex.posts:
            if x in self._posted:
                continue
            t = self._transfer(x)
            link = x.link - self.program.boundaries
            dtype = self._dtype[x.link] if link < 0 else self._micro[self.program.recycle[link].index][0].dtype
            buf = torch.empty(_shape(t.dst_box), dtype=dtype, device=self.rt.group_cache.p2p_device)
            self._posted[x] = (dist.irecv(buf, x.src, group=self._group(x), tag=self._tag(x)), buf)

    def _receive(self, ex: Exchange) -> None:
        """The action's receives (posted here, or before the action ahead of it computed);
        some are for later actions: kept until then."""
        self._post(ex)
        for x in ex.posts:
            work, buf = self._posted.pop(x)
            start = time.perf_counter()
            work.wait()
            self.stats.wait_s += time.perf_counter() - start
            self._got[x] = buf.to(self.rt.device)

    def _take(self, needs: tuple[Message, ...], into: dict[int, torch.Tensor]) -> None:
        """Place each received piece in its link's tensor (gradients add up)."""
        for x in needs:
            t, piece = self._transfer(x), self._got.pop(x)
            target = _region(into[x.link], t.dst_box)
            target.add_(piece) if x.grad or t.add else target.copy_(piece)

    def _send(self, ex: Exchange, values: dict[int, torch.Tensor]) -> None:
        """Post the action's sends (pieces of ``values``, link -> tensor) in the model's order;
        pieces for this rank itself are kept for the action that reads them."""
        for x in ex.local + ex.sends:
            data = _region(values[x.link], self._transfer(x).src_box).detach().contiguous()
            if x.dst == self.rt.rank:
                self._got[x] = data
                continue
            direction = Direction.BACKWARD if x.grad else Direction.FORWARD
            self.rt.group_cache.counter.record(CommKind.P2P, direction, (self.rt.rank, x.dst),
                                               data.numel() * data.element_size())
            data = data.to(self.rt.group_cache.p2p_device)
            self._pending.append((dist.isend(data, x.dst, group=self._group(x), tag=self._tag(x)), data))

    def _drop_sent(self) -> None:
        """Free the buffers of sends that have completed (the rest are waited on at the end)."""
        left = []
        for work, data in self._pending:
            if work.is_completed():
                work.wait()  # raises if the send failed
            else:
                left.append((work, data))
        self._pending = left

    # ------------------------------------------------------------ loss
    def _reported_loss(self) -> Callable[[], float]:
        """The step's loss on every rank (each partial term counted once, from the last stage):
        its terms' messages posted, or their sum over ranks started; the result waits and
        reads it."""
        prog, world = self.program, self.program.world_size
        if world == 1:
            loss = self._loss  # this step's: the next step rebinds self._loss
            return lambda: float(loss)
        if self.loss_messages is not None:
            return self.loss_messages.reader(self._loss)
        buf = torch.zeros(2 * world, dtype=torch.float64, device=self.rt.device)
        if prog.loss is not None:
            index = prog.loss_partial[0]
            buf[index] = self._loss
            buf[world + index] = 1.0
        work = dist.all_reduce(buf, async_op=True)

        def value() -> float:
            work.wait()
            counts = buf[world:]
            return float((buf[:world][counts > 0] / counts[counts > 0]).sum())
        return value
