"""A mean loss with no sum over ranks in forward, as under DDP.

Two passes, each exact.

**The loss stays each rank's term** (:func:`keep_loss_partial`).

A data-parallel mean loss is captured as ``sum(kept) / count``
(:mod:`torchweave.capture.normalize`). Each rank holds a partial ``sum`` of its
own rows, and lowering sums it over the ranks before the division: a blocking
all-reduce of one number in every forward, which DDP does not have (each DDP
rank backpropagates its own mean). Division by a number every rank holds alike
is linear in the numerator, so ``sum_r / count`` on each rank is that rank's
term of the loss, and the terms add up to it. The sum moves to where the loss is
reported (the executor's loss group, summed while the optimizer steps), and
backward is unchanged: each rank's term gets gradient 1, as the all-reduce's
identity backward gave its input before.

The move applies when the loss is a ``div.Tensor`` whose numerator is read only
there, through a lone sum all-reduce with an identity backward, from partial
pieces that each rank holds of the whole (scalar) value, whose denominator no
trainable parameter reaches (its gradient would need every rank's numerator),
and whose output every rank holds whole; not inside a co-sharded region or a
recompute group.

**Counts from the whole input** (:func:`count_from_inputs`). The denominator, the
number of targets not ignored, is summed over ranks too. Every rank holds every
graph input whole (the generated code cuts its rows out itself), so a partial sum
that depends on integer inputs alone (no parameter, nothing differentiable, no
random draw, no recycled input) is computed from the whole input where the sum
would run: the same small ops on all rows (a compare and a count), whose result
is the sum, exactly. Only where the sum gives each holder the whole value and its
reader reads that with no further step. The recomputation
is marked auxiliary: the simulator does not cost a compare of the targets as work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.utils._pytree as pytree

from torchweave.lower.coshard import coshard_key
from torchweave.lower.defer import drop_comms, renamed_reads
from torchweave.lower.program import Comm, Compute, LocalRef
from torchweave.lower.steps import AllReduce
from torchweave.ir.graph import Ref
from torchweave.ops import info
from torchweave.plan.layout import Layout, Piece, full_box

if TYPE_CHECKING:
    from torchweave.lower.lower import Lowering


def keep_loss_partial(low: "Lowering") -> None:
    """Drop the forward sum of a mean loss's numerator; the loss becomes each rank's term."""
    graph, loss = low.graph, low.graph.loss
    node = low.nodes.get(low.producer.get(loss, "")) if loss is not None else None
    if node is None or node.target != "aten.div.Tensor" or len(node.args) != 2 or node.kwargs:
        return
    num_name, den_name = (getattr(a, "name", None) for a in node.args)
    if num_name is None or den_name is None or den_name in low.graph.grad_values():
        return  # a denominator with a gradient would get only this rank's term's share
    if coshard_key(low.plan, node.name) is not None or node.name in low.rerun:
        return
    if [n.name for n in graph.nodes if any(r.name == num_name for r in n.input_refs())] \
            != [node.name]:
        return
    shape = graph.values[loss].meta.shape
    held_num, held_loss = low.held.get(num_name, {}), low.held.get(loss, {})
    if shape != () or graph.values[num_name].meta.shape != () or set(held_num) != set(held_loss) \
            or any(not p.is_partial for p in held_num.values()) \
            or any(p.is_partial for p in held_loss.values()):
        return
    comms = [(prog.rank, i) for prog in low.programs for i in prog.instrs
             if isinstance(i, Comm) and i.value == num_name and i.consumer == node.name]
    steps = {id(c.step): c.step for _, c in comms}
    if len(steps) != 1 or sorted(d for d, _ in comms) != sorted(held_num):
        return
    (step,) = steps.values()
    if not isinstance(step, AllReduce) or step.op != "sum" or step.bwd != "identity":
        return
    for prog in low.programs:
        prog.instrs = drop_comms(prog.instrs, {id(step)})
    low.held[loss] = {d: Piece(p.box, held_num[d].partial) for d, p in held_loss.items()}
    low.layouts[loss] = Layout.of(shape, low.held[loss])


_MAX_CONE = 8
"""Nodes a count may take from the inputs (a compare, a cast, a sum: a few)."""


def _integer_cone(low: "Lowering", value: str) -> list[str] | None:
    """The nodes ``value`` is computed by from graph inputs alone, in graph order, if every
    input they read is an integer or boolean tensor the generated code gets whole (not a
    multi-forward plan's recycled input), and none draws random numbers; else None."""
    recycled = _recycled_inputs(low)
    nodes: set[str] = set()
    todo = [value]
    while todo:
        v = todo.pop()
        val = low.graph.values[v]
        if val.kind == "input":
            if val.meta.dtype.is_floating_point or val.meta.dtype.is_complex or v in recycled:
                return None
            continue
        node = low.producer.get(v)
        if val.kind != "activation" or node is None:
            return None
        if node in nodes:
            continue
        nodes.add(node)
        spec = info(low.graph, low.nodes[node]).spec
        if len(nodes) > _MAX_CONE or len(low.nodes[node].outputs) != 1 or spec is None \
                or spec.random or coshard_key(low.plan, node) is not None:
            return None
        todo += [r.name for r in low.nodes[node].input_refs()]
    return [n.name for n in low.graph.nodes if n.name in nodes]


def _recycled_inputs(low: "Lowering") -> set[str]:
    pipe = low.plan.pipeline
    if pipe is None or pipe.recycle is None:
        return set()
    return {inp for inp, _ in pipe.recycle.links}


def count_from_inputs(low: "Lowering") -> None:
    """Replace each sum over ranks of a partial integer-input value by computing it whole.

    Only where the sum gives each holder the whole value and its reader reads that with no
    further step. Whether a step is replaced, and the names its replacement writes, are
    decided once per step, so every rank of its group does the same."""
    taken = set(low.graph.values)
    decided: dict[int, tuple[list[str], dict[str, str]] | None] = {}
    for prog in low.programs:
        out: list = []
        done: set[str] = set()
        rename: dict[str, str] = {}
        read_on = {n for i in prog.instrs if isinstance(i, Comm) for n in i.reads()}
        for ins in prog.instrs:
            step = ins.step if isinstance(ins, Comm) else None
            if isinstance(step, AllReduce) and id(step) not in decided:
                decided[id(step)] = _decide(low, ins, step, read_on, taken)
            plan = decided.get(id(step)) if step is not None else None
            if plan is None:
                out.append(renamed_reads(ins, rename))
                continue
            cone, names = plan
            calls = _whole(low, prog.rank, cone, names, ins.consumer)
            out += calls
            rename[ins.dst] = calls[-1].outputs[0]
            done |= set(cone)
        prog.instrs = _unread_dropped(out, done, low.graph.loss) if done else out


def _decide(low: "Lowering", comm: Comm, step: AllReduce, read_on: set[str], taken: set[str]
            ) -> tuple[list[str], dict[str, str]] | None:
    """(the cone, its whole values' local names) if ``comm``'s sum may be computed whole."""
    held = low.held.get(comm.value, {})
    whole = full_box(low.graph.values[comm.value].meta.shape)
    if step.op != "sum" or not held or any(not p.is_partial or p.box != whole
                                           for p in held.values()) \
            or comm.dst in read_on:  # another step follows the sum: it expects the sum's layout
        return None
    cone = _integer_cone(low, comm.value)
    if cone is None:
        return None
    names: dict[str, str] = {}
    for name in cone:
        out = low.nodes[name].outputs[0]
        local, k = f"{out}_whole", 1
        while local in taken:
            local, k = f"{out}_whole{k}", k + 1
        taken.add(local)
        names[out] = local
    return cone, names


def _unread_dropped(instrs: list, nodes: set[str], loss: str | None) -> list:
    """``instrs`` without the pieces of ``nodes`` whose outputs nothing reads any more (the
    partial counts a whole count replaced)."""
    while True:
        read = {loss} | {n for i in instrs for n in (i.reads() if isinstance(i, (Compute, Comm))
                                                       else [])}
        keep = [i for i in instrs if not (isinstance(i, Compute) and i.node in nodes and not i.aux
                                          and not read & set(i.outputs))]
        if len(keep) == len(instrs):
            return instrs
        instrs = keep


def _whole(low: "Lowering", device: int, cone: list[str], names: dict[str, str], reader: str
           ) -> list[Compute]:
    """``cone``'s nodes on the whole inputs, writing ``names``; run for ``reader`` (a
    pipeline puts them in its stage, where the cone's own nodes may not be)."""
    calls = []
    for name in cone:
        node = low.nodes[name]
        args, kwargs = pytree.tree_map(
            lambda a: LocalRef(names.get(a.name) or low.local.get((a.name, device), a.name))
            if isinstance(a, Ref) else a, (node.args, node.kwargs))
        calls.append(Compute(reader, node.target, tuple(args), dict(kwargs),
                             (names[node.outputs[0]],), node.output_structure,
                             "whole, from the whole input: no sum over ranks", aux=True))
    return calls
