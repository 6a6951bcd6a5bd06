"""Plan → one Program per rank.

Walk the graph once. For each node: find what each of its pieces reads, derive
the communication from where those tensors are to where they are needed
(shared by every consumer that needs the same layout), then emit the piece's
compute on its device and record where its outputs now live.
"""

from __future__ import annotations

from dataclasses import replace

from torchweave.ir.graph import Graph, Node, Ref
from torchweave.lower.check import check_program
from torchweave.lower.coshard import coshard_key, coshard_regions, coshare_id, lower_region
from torchweave.lower.defer import defer_replicated_sums, read_kind
from torchweave.lower.derive import Need, derive, point_to_point
from torchweave.lower.copies import stage_copies
from torchweave.lower.loss import count_from_inputs, keep_loss_partial
from torchweave.lower.pieces import (
    PieceInfo, local_call, node_pieces, output_piece, tensor_box,
)
from torchweave.lower.program import (
    Comm, Compute, InputSlot, LocalRef, ParamSlot, Program, RecycleLink,
)
from torchweave.lower.op_order import ordered_nodes
from torchweave.lower.route import route_exchanges
from torchweave.lower.stages import insert_frees, split_stages
from torchweave.lower.steps import AllGather, Box, Group, devices_of, name_of
from torchweave.ops import info
from torchweave.plan.layout import Layout, Piece, full_box, hull
from torchweave.plan.plan import Plan
from torchweave.plan.schedules import Kind
from torchweave.plan.recycle import Recycle, resolve_links
from torchweave.plan.validate import PlanError, validate


class Lowering:
    """State of one lowering pass (kept in one object, not passed around)."""

    def __init__(self, graph: Graph, plan: Plan) -> None:
        self.graph, self.plan = graph, plan
        self.world = plan.world_size
        self.programs = [Program(r, self.world, plan.name, [], mesh=str(plan.mesh or ""))
                         for r in range(self.world)]
        self.held: dict[str, dict[int, Piece]] = {}
        self.local: dict[tuple[str, int], str] = {}  # (value, device) → local name
        self.cache: dict[tuple, tuple[dict[int, Piece], str]] = {}
        self.groups: dict[Group, int] = {}
        self.param_grad: dict[str, tuple[Group, ...]] = {}
        self.param_needs: dict[str, dict[int, Piece]] = {}
        self.copied: set[str] = set()
        """Parameters each pipeline stage that reads them keeps a copy of (``lower/copies.py``)."""
        self.counter = 0
        self.layouts: dict[str, Layout] = {}
        self.producer = {o: n.name for n in graph.nodes for o in n.outputs if o}
        self.input_reads: dict[str, dict[int, Box]] = {}
        """Graph input → the region of it each device reads (their bounding box)."""
        self.nodes = {n.name: n for n in graph.nodes}
        self.grad_values = graph.grad_values()
        """Values backward makes a gradient of: a read of any other sums none (a constant mask)."""
        self.reads: list[tuple[str, str, object]] = []
        """(value, reading node, how it got there: :func:`torchweave.lower.defer.read_kind`)."""
        self.grad_steps: dict[str, list] = {}
        """Value → the grad_all_reduce steps that are all it needed (candidates to defer)."""
        self._kinds: dict[tuple, object] = {}
        self.received: dict[tuple[str, int], str] = {}
        """(value, device) → a local name of a piece of it received from another stage."""
        self.rerun: set[str] = set()
        """Nodes run again in backward (recompute groups, co-shard regions)."""
        self.split_backward = False
        """A schedule with W actions: backward runs each saved read twice (runtime/zb.py)."""
        self.whole: set[str] = set()
        """Local names a node that runs again in backward reads: a gather that makes one keeps
        it whole, not regathered (a recompute group or co-shard region keeps its inputs)."""

    # ------------------------------------------------------------ driver
    def run(self) -> list[Program]:
        self._plan_params()
        self._place_inputs()
        nodes, i = ordered_nodes(self.graph, self.plan), 0  # op-order: lower/op_order.py
        region = coshard_regions(self.graph, self.plan)
        self.rerun = set(region) | {n for g in self.plan.recompute for n in g}
        pipe = self.plan.pipeline
        self.split_backward = pipe is not None and any(
            a.kind is Kind.W for row in pipe.schedule.values() for a in row)
        while i < len(nodes):
            r = region.get(nodes[i].name)
            if r is None:
                self._node(nodes[i])
                i += 1
                continue
            j = i + 1
            while j < len(nodes) and region.get(nodes[j].name) == r:
                j += 1
            key = coshard_key(self.plan, nodes[i].name)
            assert key is not None
            lower_region(self, nodes[i:j], *key)
            i = j
        defer_replicated_sums(self)
        keep_loss_partial(self)
        count_from_inputs(self)
        route_exchanges(self)
        self._finish()
        return self.programs

    def _place_inputs(self) -> None:
        for i, name in enumerate(self.graph.inputs):
            meta = self.graph.values[name].meta
            self.held[name] = {d: Piece(full_box(meta.shape)) for d in range(self.world)}
            for d in range(self.world):
                self.local[(name, d)] = name
                self.programs[d].inputs.append(InputSlot(name, i, self.graph.values[name].target))

    def _input_needs(self, node: Node, coshard: bool = False):
        """(ref, spec, needs) for each tensor input, and the node's pieces by device.

        For a co-sharded node, a device's need is the union of what its chunks read:
        the region provides that once (see lower/coshard.py)."""
        bound = info(self.graph, node).bound
        by_device: dict[int, list[PieceInfo]] = {}
        for p in node_pieces(self.plan, node.name):
            by_device.setdefault(p.device, []).append(p)
        out = []
        for ref, tspec in zip(node.input_refs(), bound.annotation.inputs):
            shape = self.graph.values[ref.name].meta.shape
            needs = {d: Need(hull([tensor_box(bound, tspec, shape, p) for p in ps]),
                             coshare_id(self.plan, node.name, ps[0])) if coshard else
                        Need(tensor_box(bound, tspec, shape, ps[0]), ps[0].piece_id)
                     for d, ps in by_device.items()}
            out.append((ref, tspec, needs))
        return out, by_device

    def _plan_params(self) -> None:
        """Where each parameter lives (its first reader's pieces, and in a pipeline a copy
        on each other rank that reads it: ``lower/copies.py``), and whether its
        gradient sum can wait for the bucketed sync: only when every reader
        needs no communication and sums over the same groups. Otherwise each
        reader's path sums its own gradients in backward, so that partial and
        full contributions never mix in one local gradient."""
        readers: dict[str, list[dict[int, Need]]] = {}
        for node in self.graph.nodes:
            coshard = len({p.device for p in node_pieces(self.plan, node.name)}) < \
                self.plan.num_pieces(node.name)
            for ref, tspec, needs in self._input_needs(node, coshard)[0]:
                if self.graph.values[ref.name].kind in ("param", "buffer") and not tspec.meta_only:
                    readers.setdefault(ref.name, []).append(needs)
        self.defer: dict[str, bool] = {}
        for name, all_needs in readers.items():
            held = {d: Piece(n.box) for d, n in all_needs[0].items()}
            shape = self.graph.values[name].meta.shape
            copies = stage_copies(self.graph, self.plan, name, held, all_needs)
            if copies is not None:
                held, self.param_grad[name] = copies
                self.copied.add(name)
                self.defer[name] = True
            else:
                results = [derive(shape, held, needs, defer_grad_sum=True) for needs in all_needs]
                self.defer[name] = all(not r.steps for r in results) and \
                    len({tuple(sorted(r.grad_groups)) for r in results}) == 1
            self.param_needs[name] = held
            self.held[name] = held
            for d in held:
                self.local[(name, d)] = name

    def _node(self, node: Node) -> None:
        inf = info(self.graph, node)
        bound, spec = inf.bound, inf.spec
        pieces = node_pieces(self.plan, node.name)
        by_device: dict[int, list[PieceInfo]] = {}
        for p in pieces:
            by_device.setdefault(p.device, []).append(p)
        refs = node.input_refs()
        specs = bound.annotation.inputs
        local_inputs: dict[tuple[int, int], str] = {}
        for k, (ref, tspec) in enumerate(zip(refs, specs)):
            meta = self.graph.values[ref.name].meta
            held = self.held.get(ref.name, {})
            if tspec.meta_only:  # only its dtype is read: any piece on the device will do
                got = {d: self.local.get((ref.name, d), ref.name) if d in held
                       else self.received.get((ref.name, d)) for d in by_device}
                if all(name is not None for name in got.values()):
                    local_inputs.update(((k, d), name) for d, name in got.items())
                    continue
            if tspec.meta_only and self._between_stages(ref.name, node):
                # one element from the stage that holds it, not the whole tensor (nor its
                # gradient back): a norm's ``type_as(x)`` would otherwise move ``x`` whole
                needs = {d: Need(tuple((0, min(1, n)) for n in meta.shape), ps[0].piece_id)
                         for d, ps in by_device.items()}
            else:
                needs = {d: Need(tensor_box(bound, tspec, meta.shape, ps[0]), ps[0].piece_id)
                         for d, ps in by_device.items()}
            names = self._provide(ref.name, needs, node)
            for d, name in names.items():
                local_inputs[(k, d)] = name
        outs = self.graph.output_metas(node)
        leaves, tree = node.flat()
        for d, (p,) in sorted(by_device.items()):
            k = iter(range(len(refs)))
            args, kwargs = tree.unflatten(
                [LocalRef(local_inputs[(next(k), d)]) if isinstance(x, Ref) else x for x in leaves])
            out_box = tensor_box(bound, bound.annotation.outputs[0], outs[0].shape, p) if outs else ()
            fn, args, kwargs = local_call(spec, node.target, args, kwargs, bound, out_box, p)
            names = tuple(f"{o}" if o else "" for o in node.outputs)
            comment = self._comment(bound, outs, p)
            self.programs[d].instrs.append(Compute(node.name, fn, args, kwargs, names,
                                                   node.output_structure, comment))
            self._mean_to_sum(spec, bound, outs, node, p, d)
        for j, (out, meta) in enumerate(zip(node.outputs, outs)):
            if not out:
                continue
            reduce = "lse" if spec is not None and spec.partial == "lse" else "sum"
            self.held[out] = {d: output_piece(bound, bound.annotation.outputs[j], meta.shape, ps[0],
                                              reduce)
                              for d, ps in by_device.items()}
            for d in by_device:
                self.local[(out, d)] = out
            self.layouts[out] = Layout.of(meta.shape, self.held[out])

    def _mean_to_sum(self, spec, bound, outs, node: Node, p: PieceInfo, d: int) -> None:
        """A split mean gives partial means; scale them into partial sums."""
        if spec is None or spec.partial != "avg":
            return
        for j, (out, meta) in enumerate(zip(node.outputs, outs)):
            count = output_piece(bound, bound.annotation.outputs[j], meta.shape, p).partial[1]
            if out and count > 1:
                self.programs[d].instrs.append(Compute(
                    node.name, "aten.div.Scalar", (LocalRef(out), count), {}, (out,), "single",
                    f"partial mean → partial sum over {count} pieces", aux=True))

    def _comment(self, bound, outs, p: PieceInfo) -> str:
        if not outs:
            return ""
        box = tensor_box(bound, bound.annotation.outputs[0], outs[0].shape, p)
        shape = ", ".join(str(b - a) for a, b in box)
        split = " ".join(f"{d}{k}/{n}" for d, (k, n) in sorted(p.chunks.items()))
        return f"({shape})  {bound}" + (f"  [{split}]" if split else "")

    # ------------------------------------------------------------ communication
    def _provide(self, value: str, needs: dict[int, Need], node: Node) -> dict[int, str]:
        """Local names, per device, of ``value`` laid out as ``needs`` asks.

        Readers that need the same layout share one set of steps, so a
        gradient flowing back through them is summed once.
        """
        v = self.graph.values[value]
        is_param = v.kind in ("param", "buffer")
        if is_param and value not in self.held:  # read only for its dtype: keep it where asked
            self.held[value] = self.param_needs[value] = {d: Piece(n.box) for d, n in needs.items()}
            for d in needs:
                self.local[(value, d)] = value
            self.defer[value] = True
        if v.kind == "input":
            reads = self.input_reads.setdefault(value, {})
            for d, n in needs.items():
                reads[d] = hull([reads[d], n.box]) if d in reads else n.box
        key = (value, tuple(sorted((d, n.box, n.piece_id) for d, n in needs.items())))
        if key in self.cache:
            self.reads.append((value, node.name, self._kinds[key]))
            if node.name in self.rerun:
                self.whole.update(self.cache[key].values())  # (see _finish)
            return dict(self.cache[key])
        if self._between_stages(value, node):
            # a pipeline boundary: explicit transfers, whose backward sends the gradient to
            # every holder (also holders that do not read it, such as a shared stage's devices)
            der = point_to_point(v.meta.shape, self.held[value], needs)
        else:
            der = derive(v.meta.shape, self.held[value], needs,
                         defer_grad_sum=is_param and self.defer[value],
                         differentiable=value in self.grad_values)
        self._kinds[key] = kind = read_kind(der.steps)
        self.reads.append((value, node.name, kind))
        if isinstance(kind, frozenset):
            self.grad_steps.setdefault(value, []).append(der.steps[0])
        if is_param and value not in self.copied:
            if der.grad_groups:
                self.param_grad[value] = der.grad_groups
            else:
                self.param_grad.setdefault(value, ())
        current = {d: self.local.get((value, d), value) for d in self.held[value]}
        for k, step in enumerate(der.steps):
            # only the gather the reader reads (an earlier one in a chain is saved by none)
            if k == len(der.steps) - 1 and not self.split_backward and _regathers(step, v):
                step = replace(step, regather=True)
            self.counter += 1
            new = f"{value}_{name_of(step)}{self.counter}"
            self._group_ids(step)
            for d in sorted(devices_of(step)):
                self.programs[d].instrs.append(Comm(step, value, current.get(d, value), new,
                                                    f"{name_of(step)} for {node.name}", node.name))
                current[d] = new
        names = {d: current.get(d, value) for d in needs}
        if node.name in self.rerun:
            self.whole.update(names.values())  # (see _finish)
        self.cache[key] = names
        if self._between_stages(value, node):
            for d, name in names.items():
                if d not in self.held[value]:
                    self.received.setdefault((value, d), name)
        return dict(names)

    def _between_stages(self, value: str, node: Node) -> bool:
        pipe = self.plan.pipeline
        src = self.producer.get(value)
        return pipe is not None and src is not None and pipe.stage_of[src] != pipe.stage_of[node.name]

    def _group_ids(self, step) -> None:
        for g in getattr(step, "groups", ()):
            self.groups.setdefault(g, len(self.groups))

    # ------------------------------------------------------------ finish
    def _finish(self) -> None:
        for name, held in self.param_needs.items():
            v = self.graph.values[name]
            for g in self.param_grad.get(name, ()):
                self.groups.setdefault(g, len(self.groups))
            for d, piece in held.items():
                groups = tuple(g for g in self.param_grad.get(name, ()) if d in g)
                replicas = sum(1 for q in held.values() if q.box == piece.box)
                self.programs[d].params.append(ParamSlot(
                    name, v.target, piece.box, v.meta.shape, v.requires_grad,
                    v.kind == "buffer", groups, replicas, v.part, name in self.copied))
        loss = self.graph.loss
        if loss is not None:
            held = self.held[loss]
            for d, piece in held.items():
                prog = self.programs[d]
                prog.loss = self.local[(loss, d)]
                prog.loss_partial = piece.partial
                if piece.is_partial:
                    group = tuple(sorted(e for e, q in held.items() if q.box == piece.box))
                    prog.loss_group = group
                    self.groups.setdefault(group, len(self.groups))
        plan = self.plan
        if plan.zero and plan.mesh is not None and plan.zero_axis in plan.mesh.names():
            # every rank creates every ZeRO group (process groups are created collectively),
            # also where a device order makes them differ from the gradient groups
            for g in plan.mesh.groups(plan.zero_axis):
                self.groups.setdefault(g, len(self.groups))
        ordered = sorted(self.groups, key=self.groups.get)
        for prog in self.programs:
            prog.groups = ordered
            if self.whole:
                prog.instrs = [replace(i, step=replace(i.step, regather=False))
                               if isinstance(i, Comm) and i.dst in self.whole
                               and getattr(i.step, "regather", False) else i for i in prog.instrs]
            # ``del`` each local tensor after its last use (keeps peak memory honest)
            prog.instrs = insert_frees(prog.instrs, {prog.loss or ""} | {i.local for i in prog.inputs})


def _regathers(step, value) -> bool:
    """Megatron-LM's rule for sequence parallelism: a gathered activation whose readers are
    different pieces of a split op (the gather's backward reduce-scatters) is saved for
    backward as its shard and gathered again there (:mod:`torchweave.runtime.regather`).
    Not for parameters (their pieces are held anyway); nor, decided by the caller, where a
    reader runs again in backward (``Lowering.whole``) or under a schedule that splits
    backward in two (zero-bubble's I and W would both read what a matmul saved)."""
    return (isinstance(step, AllGather) and step.bwd == "reduce_scatter"
            and value.kind not in ("param", "buffer") and value.meta.dtype.is_floating_point)


def recycle_links(low: Lowering, recycle: Recycle) -> list[RecycleLink]:
    """The transfers that carry each recycled output to the devices that read its input."""
    links, problems = resolve_links(low.graph, recycle)
    if problems:
        raise PlanError(problems)
    out = []
    for link in links:
        reads = low.input_reads.get(link.input, {})
        if not reads:
            continue  # read for its shape only: nothing to carry
        shape = low.graph.values[link.input].meta.shape
        der = point_to_point(shape, low.held[link.output], {d: Need(box, d) for d, box in reads.items()})
        (step,) = der.steps
        sources = {t.src for t in step.transfers}
        assert all(low.local.get((link.output, d), link.output) == link.output for d in sources)
        out.append(RecycleLink(link.input, link.index, link.output, step, tuple(sorted(reads.items()))))
    return out


def lower(graph: Graph, plan: Plan, *, stages: bool = True) -> list[Program]:
    """Validate ``plan`` and lower it to one Program per rank. ``stages=False``: leave a
    pipelined plan's Programs whole, without the per-stage segments, actions and messages
    the runtime runs (the simulator reads the instructions and the plan's stages only)."""
    validate(plan, graph)
    low = Lowering(graph, plan)
    programs = low.run()
    # each later pass returns new Programs: what one pass made, the next only reads
    if plan.pipeline is not None and plan.pipeline.recycle is not None:
        links = recycle_links(low, plan.pipeline.recycle)
        programs = [replace(p, passes=plan.pipeline.passes, recycle=links) for p in programs]
    if plan.pipeline is not None and stages:
        programs = split_stages(programs, graph, plan)
    recompute = [tuple(g) for g in plan.recompute]
    programs = [replace(p, recompute=list(recompute)) for p in programs]
    # the contract codegen, the runtime and the simulator rely on
    check_program(programs, names=stages or plan.pipeline is None)
    return programs
