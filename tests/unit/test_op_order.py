"""op-order reaches lowering: the forward runs in the order the plan asks, on every rank,
and op-orders lowering cannot realize are refused before launch (lower/op_order.py)."""

from __future__ import annotations

import pytest

from tests.conftest import captured
from torchweave.lower.check import check_program
from torchweave.lower.lower import lower
from torchweave.lower.program import Compute
from torchweave.plan.plan import Plan, PieceRef
from torchweave.plan.validate import PlanError
from torchweave.policies import resolve

Q, V = "linear_nobias", "linear_2_nobias"  # block 0's q and v projections: independent


def v_before_q(graph, world_size: int, text: str = "tp") -> Plan:
    """``text``'s plan with block 0's v projection ordered before its q projection, piece by
    piece on each device."""
    plan = resolve(text, graph, world_size)
    for pv in plan.pieces(V):
        d = plan.device_of(V, pv)
        for pq in plan.pieces(Q):
            if plan.device_of(Q, pq) == d:
                plan.order(PieceRef(V, pv), PieceRef(Q, pq))
    return plan


def _computes(prog) -> list[str]:
    return [i.node for i in prog.instrs if isinstance(i, Compute)]


@pytest.mark.parametrize("text", ["tp", "dp", "zero3"])
def test_the_forward_runs_in_the_order_asked_and_moves_nothing_else(text: str) -> None:
    graph = captured("gpt-tiny")
    plain = lower(graph, resolve(text, graph, 2))
    ordered = lower(graph, v_before_q(graph, 2, text))
    check_program(ordered)
    for a, b in zip(plain, ordered):
        before, after = _computes(a), _computes(b)
        assert before.index(Q) < before.index(V) and after.index(V) < after.index(Q)
        moved = [n for n in after if n != V]
        assert moved == [n for n in before if n != V]  # only the v projection moved
        assert after.index(V) == before.index(Q)  # to just before q


def test_op_orders_that_cannot_be_realized_are_refused_with_the_rule() -> None:
    graph = captured("gpt-tiny")

    def refused(plan: Plan, rule: str) -> None:
        with pytest.raises(PlanError) as info:
            lower(graph, plan)
        assert rule in str(info.value), str(info.value)

    plan = resolve("dp", graph, 2)  # against the data flow: its bias add reads q
    plan.order(PieceRef("linear", (0,)), PieceRef(Q, (0,)))
    refused(plan, "no cycle at node level")
    plan = resolve("tp", graph, 2)  # both ways, on different pieces: a cycle of nodes only
    ps = list(plan.pieces(V))
    (q0,), (q1,) = ([p for p in plan.pieces(Q) if plan.device_of(Q, p) == plan.device_of(V, v)]
                    for v in ps)
    plan.order(PieceRef(V, ps[0]), PieceRef(Q, q0)).order(PieceRef(Q, q1), PieceRef(V, ps[1]))
    refused(plan, "no cycle at node level")
    plan = resolve("interleaved:micro=2", graph, 2)  # across stages: the schedule's job
    stage_of = plan.pipeline.stage_of
    a = next(n.name for n in graph.nodes if stage_of.get(n.name) == 0)
    b = next(n.name for n in graph.nodes if stage_of.get(n.name) == 2)
    pa = next(p for p in plan.pieces(a) if plan.device_of(a, p) == 0)
    pb = next(p for p in plan.pieces(b) if plan.device_of(b, p) == 0)
    plan.order(PieceRef(b, pb), PieceRef(a, pa))
    refused(plan, "op-orders relate nodes of one pipeline stage")
    plan = resolve("dp:coshard=mlp:2", graph, 2)  # chunks of one node against row-major
    fc_in = next(n.name for n in graph.nodes if n.module == "blocks.0.mlp.fc_in")
    ps = [p for p in plan.pieces(fc_in) if plan.device_of(fc_in, p) == 0]
    assert len(ps) == 2
    plan.order(PieceRef(fc_in, ps[1]), PieceRef(fc_in, ps[0]))
    refused(plan, "the pieces of one node run in row-major order")


def test_op_orders_and_co_sharded_regions() -> None:
    """A region runs chunk by chunk: an op-order inside it must agree with that; two
    regions an op-order brings side by side stay two regions (from a review)."""
    from torchweave.policies.coshard import with_coshard

    graph = captured("gpt-tiny")
    plan = resolve("dp:coshard=mlp:2", graph, 2)
    fc_in = next(n.name for n in graph.nodes if n.module == "blocks.0.mlp.fc_in")
    gelu = next(n.name for n in graph.nodes if n.module == "blocks.0.mlp" and "gelu" in n.name)
    plan.order(PieceRef(fc_in, (0, 0)), PieceRef(gelu, (0, 0)))  # as it runs: accepted
    check_program(lower(graph, plan))
    plan.order(PieceRef(fc_in, (0, 1)), PieceRef(gelu, (0, 0)))  # chunk 1 before chunk 0
    with pytest.raises(PlanError, match="chunk by chunk"):
        lower(graph, plan)

    plan = resolve("dp", graph, 2)
    plan = with_coshard(plan, graph, ["layer_norm"], 2, dim="b")
    plan = with_coshard(plan, graph, ["linear_1_nobias"], 2, dim="e0")
    for d in range(2):
        k = [p for p in plan.pieces("linear_1_nobias") if plan.device_of("linear_1_nobias", p) == d]
        q = [p for p in plan.pieces(Q) if plan.device_of(Q, p) == d]
        plan.order(PieceRef("linear_1_nobias", k[0]), PieceRef(Q, q[0]))
    progs = lower(graph, plan)  # the k projection now follows the norm: two regions still
    check_program(progs)
    names = _computes(progs[0])
    assert names.index("linear_1_nobias") < names.index(Q)


def test_op_orders_survive_the_plan_file_and_the_simulator_runs_them() -> None:
    """Plans are read and changed as JSON: an op-order written there is what lowering and
    the simulator (no fast path: replicas or blocks may differ in order) run."""
    from torchweave.sim import parse_cluster, simulate

    graph = captured("gpt-tiny")
    plan = Plan.from_json(v_before_q(graph, 2).to_json())
    assert plan.orders and _computes(lower(graph, plan)[0]).index(V) < \
        _computes(lower(graph, plan)[0]).index(Q)
    res = simulate(graph, plan, parse_cluster("2xA100-80GB-SXM"))
    assert res.step_time > 0
