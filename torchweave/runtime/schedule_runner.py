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
(:mod:`torchweave.lower.messages`), as :mod:`torchweave.runtime.stage_messages`
says: each pair of ranks issues its messages in one order, which the dry run
checked. ``StepConfig.p2p_tags`` sends every message with tag 0 (``untagged``,
the default on NCCL, which ignores tags) or tags each (``tagged``, the default
on gloo, where a message out of order then waits instead of landing in the
wrong tensor).

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
from torchweave.lower.program import Exchange, Segment
from torchweave.lower.stages import reads
from torchweave.plan.schedules import Action, Kind
from torchweave.runtime.executor import RankModule
from torchweave.runtime.loss_messages import LossMessages
from torchweave.runtime.regather import Forward, forward_hooks
from torchweave.runtime.stage_messages import StageMessages, region
from torchweave.runtime.zb import SplitBackward

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
        self.messages = StageMessages(prog, self.rt.rank, self.rt.group_cache, self.config.p2p_tags)
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
        self.messages.begin({self.program.boundaries + i: self._micro[link.index][0].dtype
                             for i, link in enumerate(self.program.recycle)})
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
            self.messages.drop_sent()
        self.sync.enabled = False
        if self.loss_messages is not None:  # once a step: here if no forward made it final
            self.loss_messages.send(self._loss)
        self.messages.finish()
        self.stats.wait_s = self.messages.wait_s
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
        self.messages.receive(ex, self.rt.device)
        if following is not None:
            self.messages.post(following)
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
            got[bd.index] = torch.zeros(dict(bd.step.shapes)[self.rt.rank], dtype=self.messages.dtype[bd.index],
                                        device=self.rt.device)
        inputs = [x[m] for x in self._micro]
        if k > 0 and s == 0:
            for i, link in enumerate(self.program.recycle):
                if self.rt.rank in dict(link.boxes):
                    inputs[link.index] = torch.zeros_like(inputs[link.index])
                    got[self.program.boundaries + i] = region(inputs[link.index], dict(link.boxes)[self.rt.rank])
        self.messages.take(ex.needs, got)
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
        self.messages.send(ex, values)
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
            self.messages.take(ex.needs, got)
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
            self.messages.send(ex, values)
            for name in seg.inputs:
                leaf = live.leaves[name]
                if leaf.grad is not None:
                    key = (name, m)
                    prev = self._handed_grad.get(key)
                    self._handed_grad[key] = leaf.grad if prev is None else prev + leaf.grad
        if to_params:
            del self._live[(s, m)]

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
