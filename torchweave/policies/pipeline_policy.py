"""Pipeline policies: stages on device groups, micro-batches, a schedule; nothing else.

``pipeline(graph, world_size, schedule=..., pp=..., tp=..., dp=..., ...)``
builds a plan from the primitives in a fixed order:

1. the tensor/data-parallel plan of one stage group (``tp`` and ``dp`` over
   ``tp * dp`` devices, by the ``tp`` or ``dp`` policy), since every stage is
   split the same way inside its group;
2. the cut: nodes, in graph order, into ``pp * virtual`` stages of about equal
   FLOPs, preferring cuts between numbered blocks (``blocks.3``);
3. op-assign of each node's pieces to its stage's group (stage ``s`` on
   pipeline rank ``s % pp``: interleaved stages loop over the groups);
4. op-order: the built-in schedule over the pipeline ranks; with
   ``recycle=P`` (multi-forward), ``P - 1`` no-gradient passes per
   micro-batch placed in its bubbles (:func:`with_recycle`).

The device mesh is ``pp × dp × tp``, row-major, so group ``k`` is devices
``k·dp·tp … (k+1)·dp·tp − 1`` and ZeRO shards over ``dp`` inside each group.
"""

from __future__ import annotations

from typing import Literal

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph
from torchweave.ops import info
from torchweave.plan.layout import Mesh
from torchweave.plan.interlaced import interlaced_1f1b
from torchweave.plan.stage_plan import ALL, Pipeline, apply_orders
from torchweave.plan.plan import Plan
from torchweave.plan.recycle import Recycle
from torchweave.plan.schedules.recycle import multi_forward
from torchweave.plan.schedules import (
    BUILTIN, Action, Kind, Schedule, builtin, check_stage_count, from_csv, loop_stage_to_rank,
)
from torchweave.policies.data import dp as dp_policy
from torchweave.policies.expert import ep as ep_policy
from torchweave.policies.recompute import block_of as _block
from torchweave.policies.tensor import sp as sp_policy
from torchweave.policies.tensor import tp as tp_policy

TiedMode = Literal["copy", "send"]
TIED: tuple[str, ...] = ("copy", "send")
"""How a pipelined plan holds a parameter read on several stages (``tied=`` in plan strings)."""
ScheduleName = Literal["gpipe", "1f1b", "interleaved", "zb"]
"""For type checkers: the names of ``SCHEDULES`` (a test holds the two equal)."""
SCHEDULES: tuple[str, ...] = BUILTIN


def mesh_degrees(world_size: int, *, pp: int | None, tp: int, dp: int | None,
                 ep: int) -> tuple[int, int]:
    """``(pp, dp)`` as a pipeline plan takes them: ``dp`` fills what ``pp × tp × ep`` leaves
    of the world (1 if ``pp`` is not given), then ``pp`` what ``tp × dp × ep`` leaves
    (0 where it does not divide)."""
    if dp is None:
        dp = world_size // (pp * tp * ep) if pp and tp and world_size % (pp * tp * ep) == 0 else 1
    inner = tp * dp * ep
    if pp is None:
        pp = world_size // inner if inner >= 1 and world_size % inner == 0 else 0
    return pp, dp


def pipeline(graph: Graph, world_size: int, *, schedule: ScheduleName = "1f1b",
             pp: int | None = None, tp: int = 1, dp: int | None = None, micro: int | None = None,
             virtual: int | None = None, stages: int | None = None, zero: int = 0,
             cuts: list[int] | list[str] | None = None, recycle: int = 1,
             dims: dict[str, str | None] | None = None, sequence: bool = False,
             ep: int = 1, tied: TiedMode = "copy") -> Plan:
    """A pipelined plan: ``pp`` groups of ``dp * ep * tp`` devices, ``micro`` micro-batches.

    Defaults: ``dp = world_size / (pp * tp)`` when ``pp`` is given, else 1;
    ``pp = world_size / (dp * tp)``, ``virtual = 2`` stages per rank
    for ``interleaved`` (else 1), ``micro = 2 * pp``. ``cuts``, when given, are
    the graph positions where stages 1, 2, … start, or the modules whose first ops start
    them (``encoder.5``, ``encoder.11.ff``: :func:`cut_positions`), instead of the
    FLOP-balanced cut.
    ``recycle`` > 1: that many forward passes per micro-batch, linked as the
    model's ``recycle`` attribute says (see :func:`with_recycle`). ``dims``: each
    node's split on ``tp`` inside a stage (see :func:`~torchweave.policies.tensor.tp`);
    ``sequence``: Megatron's split with sequence parallelism inside each stage
    (:func:`~torchweave.policies.tensor.sp`). ``ep`` > 1: each stage splits its experts
    over ``ep`` devices (:func:`~torchweave.policies.expert.ep`). ``tied``: how a parameter
    that ops on several stages read is held: ``copy`` (each stage a copy, their gradients
    summed once a step, as Megatron-LM holds a tied embedding), or ``send``
    (:func:`send_lookups`: a lookup on a later stage runs on the parameter's stage instead).
    """
    if schedule not in SCHEDULES:
        raise TorchweaveError(Problem(obj="pipeline schedule", value=repr(schedule),
                                      rule=f"one of {', '.join(SCHEDULES)}"))
    pp, dp = mesh_degrees(world_size, pp=pp, tp=tp, dp=dp, ep=ep)
    inner = tp * dp * ep
    if pp < 1 or pp * inner != world_size:
        raise TorchweaveError(Problem(
            obj=f"{schedule} plan", value=f"pp={pp}, dp={dp}, tp={tp}" + (f", ep={ep}" if ep > 1 else ""),
            rule=f"the mesh covers the world: pp({pp}) * dp({dp}) * tp({tp})"
                 + (f" * ep({ep})" if ep > 1 else "") + f" = {pp * inner} != world_size({world_size})",
            fix=f"choose pp, dp{', ep' if ep > 1 else ''} and tp whose product is {world_size}"
                + (f", or run on {pp * inner} ranks (a cluster of {pp * inner} devices)"
                   if pp >= 1 and pp * inner > world_size else "")))
    virtual = virtual or (2 if schedule == "interleaved" else 1)
    if virtual > 1 and schedule != "interleaved":
        raise TorchweaveError(Problem(obj=f"{schedule} plan", value=f"virtual={virtual}",
                                      rule="only the interleaved schedule runs several stages per rank",
                                      fix="use schedule='interleaved', or virtual=1"))
    n_stages = pp * virtual
    if stages is not None:
        check_stage_count(stages, pp, virtual)
    micro = micro or 2 * pp
    order = builtin(schedule, pp, virtual, micro)
    if sequence and dims is not None:
        raise TorchweaveError(Problem(obj=f"{schedule} plan", value="sequence and dims",
                                      rule="a stage splits by one rule: sequence parallelism "
                                           "or given dims", fix="pass one of them"))
    if ep > 1:
        if sequence or dims is not None:
            raise TorchweaveError(Problem(obj=f"{schedule} plan", value=f"ep={ep}",
                                          rule="expert parallelism splits with Megatron's rules",
                                          fix="drop split=sequence / split=solved, or ep"))
        plan = ep_policy(graph, inner, ep_size=ep, tp_size=tp, zero=zero)
    else:
        plan = _group_plan(graph, inner, tp, dp, zero, dims, sequence)
    if cuts is not None and any(isinstance(c, str) for c in cuts):
        cuts = cut_positions(graph, [str(c) for c in cuts], n_stages)
    stage_of = cut(graph, n_stages) if cuts is None else cut_at(graph, cuts, n_stages)
    if tied not in TIED:
        raise TorchweaveError(Problem(obj=f"{schedule} plan", value=f"tied={tied}",
                                      rule=f"tied is one of {', '.join(TIED)}",
                                      fix="tied=copy (the default) or tied=send"))
    if tied == "send":
        stage_of = send_lookups(graph, stage_of)
    mesh = Mesh.of(pp=pp, dp=dp, ep=ep, tp=tp) if ep > 1 else Mesh.of(pp=pp, dp=dp, tp=tp)
    groups = [tuple(range(k * inner, (k + 1) * inner)) for k in range(pp)]
    stage_rank = list(loop_stage_to_rank(n_stages, pp).values())
    for node, devices in plan.assignment.items():
        group = groups[stage_rank[stage_of[node]]]
        plan.assignment[node] = [group[d] for d in devices]
    plan.world_size, plan.mesh = world_size, mesh
    plan.name = schedule
    plan.pipeline = Pipeline(groups=groups, stage_of=stage_of, stage_rank=stage_rank,
                             micro_batches=micro, schedule=order, kind=schedule)
    plan.notes["policy"] = (f"pipeline(schedule={schedule!r}, pp={pp}, dp={dp}, tp={tp}, "
                            + (f"ep={ep}, " if ep > 1 else "") +
                            f"micro={micro}, virtual={virtual}, zero={zero}"
                            f"{', sequence' if sequence else ''})")
    if tied != "copy":
        plan.notes["policy"] += f", tied={tied}"
    if recycle != 1:
        with_recycle(plan, graph, recycle)
    return plan


def send_lookups(graph: Graph, stage_of: dict[str, int]) -> dict[str, int]:
    """``stage_of`` with each lookup of an earlier stage's parameter moved to that stage.

    A lookup here is an op that reads parameters, all first read on one earlier stage,
    and a model input, and otherwise only buffers: an encoder-decoder's decoder
    embedding, which reads the target tokens and the vocabulary the encoder's stage 0
    holds. Run on stage 0, it sends its output (one micro-batch's embeddings) to the stage
    that reads it, in place of a copy of the whole table on that stage and the sum of the
    copies' gradients once a step. An op that also reads an activation (a tied output
    head) stays where it is.
    """
    first: dict[str, int] = {}
    for node in graph.nodes:
        for ref in node.input_refs():
            if graph.values[ref.name].kind == "param":
                first[ref.name] = min(first.get(ref.name, stage_of[node.name]), stage_of[node.name])
    out = dict(stage_of)
    for node in graph.nodes:
        homes = {first[p] for p in _looked_up(graph, node)}
        if len(homes) == 1 and min(homes) < out[node.name]:
            out[node.name] = min(homes)
    return out


def shared_lookups(graph: Graph) -> list[str]:
    """The ops :func:`send_lookups` moves under some cut: lookups of a parameter that an op
    before them reads too (elsewhere ``tied=send`` builds the same plan as ``copy``)."""
    seen: set[str] = set()
    out = []
    for node in graph.nodes:
        if _looked_up(graph, node) & seen:
            out.append(node.name)
        seen.update(r.name for r in node.input_refs() if graph.values[r.name].kind == "param")
    return out


def _looked_up(graph: Graph, node) -> set[str]:
    """The parameters ``node`` looks up: it reads them and a model input, and no
    activation (a transposed weight alone would send the table itself); else empty."""
    kinds = {r.name: graph.values[r.name].kind for r in node.input_refs()}
    if "activation" in kinds.values() or "input" not in kinds.values():
        return set()
    return {name for name, kind in kinds.items() if kind == "param"}


def with_recycle(plan: Plan, graph: Graph, passes: int,
                 links: dict[str, str] | None = None) -> Plan:
    """``plan`` running ``passes`` forward passes per micro-batch, the last with gradients.

    ``links`` maps each recycled forward argument to the module (or value)
    whose output it takes on the next pass; by default the model's
    ``recycle`` attribute (``graph.meta["recycle"]``). The no-gradient passes
    are placed in the schedule's bubbles by op-order
    (:func:`~torchweave.plan.schedules.recycle.multi_forward`); the plan's own
    order of ``F``, ``B``, ``I`` and ``W`` is kept.
    """
    pipe = plan.pipeline
    if pipe is None:
        raise TorchweaveError(Problem(obj=f"plan {plan.name!r}", value="no pipeline",
                                      rule="multi-forward runs on a pipelined plan",
                                      fix="start from a pipeline policy, e.g. '1f1b:recycle=3', or "
                                          "'gpipe:pp=1,dp=N,recycle=3' for data parallelism"))
    links = links if links is not None else graph.meta.get("recycle")
    if not links:
        raise TorchweaveError(Problem(
            obj=f"model {graph.model_name!r}", value="no recycled outputs",
            rule="multi-forward needs to know which outputs come back as which inputs",
            fix="pass links={'prev': 'norm'}, or give the model a class attribute "
                "recycle = {'prev': 'norm'} (forward argument: module)"))
    if not isinstance(passes, int) or passes < 1:
        raise TorchweaveError(Problem(obj="recycle passes", value=repr(passes),
                                      rule="a whole number of forward passes >= 1"))
    base = {r: [a for a in acts if a.kind is not Kind.R] for r, acts in pipe.schedule.items()}
    stage_to_rank = {s: r for s, r in enumerate(pipe.stage_rank)}
    pipe.schedule = multi_forward(base, stage_to_rank, pipe.micro_batches, passes) \
        if not pipe.shared else base
    pipe.recycle = Recycle(passes, tuple(sorted(links.items())))
    plan.notes["recycle"] = f"{passes} passes: " + ", ".join(f"{k} <- {v}" for k, v in sorted(links.items()))
    return plan


def interlaced(graph: Graph, world_size: int, *, micro: int | None = None) -> Plan:
    """The interlaced pipeline: the token embedding before the numbered blocks and the LM
    head with its loss after them are tensor-parallel over all devices (vocabulary-parallel,
    by the ``tp`` policy) in two shared stages; the blocks between are pipelined, one stage
    per device, in 1F1B; each rank runs the shared stages' actions between its own."""
    keys = [_block(n.module) for n in graph.nodes]
    inner = [i for i, k in enumerate(keys) if k]
    if not inner or inner[-1] - inner[0] + 1 < world_size:
        raise TorchweaveError(Problem(
            obj="interlaced plan", value=f"{len(inner)} ops in numbered blocks",
            rule=f"the blocks fill the {world_size} pipelined stages",
            fix="use a model with numbered blocks (blocks.0, blocks.1, …) or fewer devices"))
    micro = micro or 2 * world_size
    plan = tp_policy(graph, world_size)
    body = graph.nodes[inner[0]:inner[-1] + 1]
    early = _before_blocks(graph, body, keys[inner[0]:inner[-1] + 1])
    body = [n for n in body if n.name not in early]
    stage_of = {n.name: 0 for n in graph.nodes[:inner[0]]}
    stage_of.update({name: 0 for name in early})
    stage_of.update({name: s + 1 for name, s in cut(graph, world_size, body).items()})
    stage_of.update({n.name: world_size + 1 for n in graph.nodes[inner[-1] + 1:]})
    for n in body:  # op-assign: the whole block op on its stage's device
        plan.trans.pop(n.name, None)
        plan.assign_all(n.name, [stage_of[n.name] - 1])
    plan.name = "interlaced"
    plan.pipeline = Pipeline(groups=[(d,) for d in range(world_size)], stage_of=stage_of,
                             stage_rank=[ALL, *range(world_size), ALL], micro_batches=micro,
                             schedule=interlaced_1f1b(world_size, micro), kind="interlaced")
    plan.notes["policy"] = f"interlaced(micro={micro})"
    return plan


def _before_blocks(graph: Graph, body: list, keys: list) -> set[str]:
    """Ops among ``body`` outside every numbered block that read no block's output, even
    through other ops: an encoder-decoder's decoder embedding, between its two stacks, reads
    only the target tokens and the shared vocabulary. The interlaced pipeline runs them in
    its first shared stage, with the other embeddings."""
    after: set[str] = set()  # values computed from a block's output
    early: set[str] = set()
    for node, key in zip(body, keys):
        late = key or any(r.name in after for r in node.input_refs())
        if late:
            after.update(o for o in node.outputs if o)
        else:
            early.add(node.name)
    return early


def _group_plan(graph: Graph, size: int, tp: int, dp: int, zero: int,
                dims: dict[str, str | None] | None = None, sequence: bool = False) -> Plan:
    """The plan of one stage group, on devices ``0 … size-1``."""
    if tp > 1:
        plan = (sp_policy(graph, size, tp_size=tp) if sequence
                else tp_policy(graph, size, tp_size=tp, dims=dims))
        plan.zero, plan.zero_axis = zero, ("dp" if zero else None)
        return plan
    return dp_policy(graph, size, zero=zero)


def module_starts(graph: Graph, depth: int | None = None) -> dict[str, int]:
    """Module path → the graph position of its first op (an op of it or of a module inside
    it), for every module with ops (``depth``: only paths of at most that many parts)."""
    first: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        parts = (node.module or "").split(".")
        for k in range(1, min(len(parts), depth or len(parts)) + 1):
            first.setdefault(".".join(parts[:k]), i)
    return first


def cut_positions(graph: Graph, modules: list[str], stages: int) -> list[int]:
    """The graph positions where stages 1, 2, … start: each module's first op (an op of
    the module or of one inside it), as plan strings name them (``cuts=encoder.5+decoder.2``)."""
    if len(modules) != stages - 1:
        raise TorchweaveError(Problem(
            obj="pipeline cuts", value="+".join(modules),
            rule=f"{stages} stages start at {stages - 1} modules, one for each stage after the "
                 f"first: got {len(modules)}",
            fix="name one module per stage after the first, in graph order"))
    first = module_starts(graph)
    out = []
    for name in modules:
        if name not in first or first[name] == 0:
            known = sorted({".".join((n.module or "").split(".")[:2]) for n in graph.nodes} - {""})
            raise TorchweaveError(Problem(
                obj="pipeline cuts", value=name,
                rule="a stage starts at a module of the model that has ops, and not at the first op"
                     if name in first else "a stage starts at a module of the model that has ops",
                fix=f"one of the model's modules, e.g. {', '.join(known[:6])}"))
        if out and first[name] <= out[-1]:
            raise TorchweaveError(Problem(
                obj="pipeline cuts", value="+".join(modules),
                rule=f"stages start in graph order: {name} starts at op {first[name]}, not after "
                     f"the stage before it (op {out[-1]})",
                fix="list the modules in the order the model runs them"))
        out.append(first[name])
    return out


def cut_modules(graph: Graph, positions: list[int]) -> list[str]:
    """The shortest module paths whose first op is each position (the inverse of
    :func:`cut_positions`), or an empty list where one has none."""
    first = module_starts(graph)
    at: dict[int, str] = {}
    for name, i in sorted(first.items(), key=lambda kv: (len(kv[0].split(".")), kv[0])):
        at.setdefault(i, name)
    return [at[p] for p in positions] if all(p in at for p in positions) else []


def cut_at(graph: Graph, cuts: list[int], stages: int) -> dict[str, int]:
    """Node → stage, stage ``j`` starting at graph position ``cuts[j - 1]``."""
    n = len(graph.nodes)
    if len(cuts) != stages - 1 or list(cuts) != sorted(set(cuts)) or not all(0 < c < n for c in cuts):
        raise TorchweaveError(Problem(
            obj="pipeline cuts", value=str(list(cuts)),
            rule=f"{stages} stages need {stages - 1} increasing cut positions in 1..{n - 1}: "
                 f"got {len(cuts)}",
            fix="one position per stage after the first, where that stage starts"))
    return {node.name: sum(1 for c in cuts if i >= c) for i, node in enumerate(graph.nodes)}


def with_schedule(plan: Plan, schedule: Schedule | str,
                  orders: list[tuple[Action, Action]] | None = None) -> Plan:
    """``plan`` with a user's schedule (a :data:`Schedule` or its CSV text), or its own schedule
    reordered by op-order constraints ``(before, after)``; checked on validate."""
    if plan.pipeline is None:
        raise TorchweaveError(Problem(obj=f"plan {plan.name!r}", value="no pipeline",
                                      rule="a schedule orders the stages of a pipelined plan",
                                      fix="start from a pipeline policy, e.g. resolve('1f1b', ...)"))
    sched = from_csv(schedule) if isinstance(schedule, str) else dict(schedule)
    plan.pipeline.schedule = apply_orders(sched, orders) if orders else sched
    plan.pipeline.kind = "custom"
    return plan


def cut(graph: Graph, stages: int, nodes: list | None = None) -> dict[str, int]:
    """Node → stage: graph order (or ``nodes``) cut into ``stages`` runs of about equal FLOPs.

    Cuts go where a numbered block starts or ends when there are enough such
    places, else anywhere. Each stage gets at least one node.
    """
    nodes = graph.nodes if nodes is None else nodes
    if stages > len(nodes):
        raise TorchweaveError(Problem(
            obj="pipeline stages", value=f"stages={stages}",
            rule=f"each stage holds at least one op: stages({stages}) > ops({len(nodes)})",
            fix="use fewer stages"))
    cost = [info(graph, n).flops + 1.0 for n in nodes]
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    keys = [_block(n.module) for n in nodes]
    places = [i for i in range(1, len(nodes)) if keys[i] != keys[i - 1]]
    if len(places) < stages - 1:
        places = list(range(1, len(nodes)))
    after = {q: len(places) - k - 1 for k, q in enumerate(places)}  # places after each
    cuts: list[int] = []
    for j in range(1, stages):
        target = prefix[-1] * j / stages
        lo = cuts[-1] if cuts else 0
        left = stages - 1 - j  # cuts still to place after this one
        options = [i for i in places if i > lo and after[i] >= left]
        cuts.append(min(options, key=lambda i: abs(prefix[i] - target)))
    out: dict[str, int] = {}
    stage = 0
    for i, n in enumerate(nodes):
        while stage < len(cuts) and i >= cuts[stage]:
            stage += 1
        out[n.name] = stage
    return out
