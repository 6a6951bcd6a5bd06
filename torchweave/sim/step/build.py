"""Programs → per-rank task lists for :mod:`torchweave.sim.step.engine`.

One training step per rank:

1. **forward** (:mod:`~torchweave.sim.step.forward`): the Program's instructions
   in order. A compute instruction is its node's roofline time scaled by the
   piece's share of the work (the product of ``1/parts`` over split transforms;
   replicas do the full work). A communication step is a collective over the
   group that holds the rank. ZeRO-3 gathers each unit before its first reader.
2. **backward** (:mod:`~torchweave.sim.step.backward`): the instructions in
   reverse, with ``bwd`` times and each step's backward dual
   (``lower/steps.py``); integer tensors carry no gradient. The gradient sync of
   each parameter (its ``grad_groups``) joins a bucket once the backward of its
   first reader is done, DDP-style; a full bucket is all-reduced
   (reduce-scattered under ZeRO-2/3) on the comm stream, overlapping the rest of
   the backward.
3. **optimizer**: AdamW, memory-bound, after every gradient sync; ZeRO-1/2
   all-gather the updated shards afterwards.

Compute times come from the roofline (:mod:`torchweave.sim.hardware.compute`)
or, where a node's piece was timed, from :mod:`torchweave.sim.hardware.profile`
(:class:`~torchweave.sim.step.context.StepContext`). Forward hands backward one
:class:`~torchweave.sim.step.state.RankForward`. Tasks speak the protocol of
:mod:`torchweave.sim.step.signals`; in pipelined plans each carries its stage
(:mod:`torchweave.sim.step.pipelined` reads them).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchweave.lower.program import Program
from torchweave.sim.step.backward import backward, place_syncs
from torchweave.sim.step.context import StepContext
from torchweave.sim.step.engine import Task
from torchweave.sim.step.forward import forward
from torchweave.sim.step.state import Footprint, NodeCost, SyncInputs


@dataclass
class Builder(StepContext):
    def tasks(self, prog: Program) -> tuple[list[Task], Footprint]:
        """One rank's step: forward, backward, gradient sums, optimizer."""
        tasks, foot, inputs = self.unsynced(prog)
        return place_syncs(self, tasks, foot, inputs, prog.rank), foot

    def unsynced(self, prog: Program) -> tuple[list[Task], Footprint, SyncInputs]:
        """Forward and backward, with markers where gradient sums may start
        (:data:`~torchweave.sim.step.signals.Kind.REACH`): tasks, footprint and what
        :func:`~torchweave.sim.step.backward.place_syncs` needs."""
        fwd, state = forward(self, prog)
        tasks = fwd + backward(self, state)
        return tasks, state.foot, SyncInputs(state.params, {p: state.nbytes[p] for p in state.params})


__all__ = ["Builder", "Footprint", "NodeCost"]
