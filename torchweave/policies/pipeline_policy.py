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
from torchweave.policies.stage_cuts import cut, cut_at, cut_positions, send_lookups
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
    them (``encoder.5``, ``encoder.11.ff``: :func:`~torchweave.policies.stage_cuts.cut_positions`), instead of the
    FLOP-balanced cut.
    ``recycle`` > 1: that many forward passes per micro-batch, linked as the
    model's ``recycle`` attribute says (see :func:`with_recycle`). ``dims``: each
    node's split on ``tp`` inside a stage (see :func:`~torchweave.policies.tensor.tp`);
    ``sequence``: Megatron's split with sequence parallelism inside each stage
    (:func:`~torchweave.policies.tensor.sp`). ``ep`` > 1: each stage splits its experts
    over ``ep`` devices (:func:`~torchweave.policies.expert.ep`). ``tied``: how a parameter
    that ops on several stages read is held: ``copy`` (each stage a copy, their gradients
    summed once a step, as Megatron-LM holds a tied embedding), or ``send``
    (:func:`~torchweave.policies.stage_cuts.send_lookups`: a lookup on a later stage runs on the parameter's stage instead).
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
        plan.notes["policy"] = plan.notes["policy"][:-1] + f", tied={tied})"
    if recycle != 1:
        with_recycle(plan, graph, recycle)
    return plan


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


