"""Plans are data: primitives, JSON, diff, table, and errors before launch."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from tests.conftest import captured
from torchweave.plan.layout import Layout, Mesh, Piece
from torchweave.plan.plan import Plan, PieceRef
from torchweave.plan.show import plan_table
from torchweave.plan.validate import PlanError, validate
from torchweave.policies import POLICIES, resolve


def first(graph, target: str):
    return next(n for n in graph.nodes if n.target == target)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_json_round_trip_and_validation(policy: str) -> None:
    graph = captured("gpt-tiny")
    plan = resolve(policy, graph, 4)
    validate(plan, graph, world_size=4)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.diff(plan) == []


def test_primitives_build_a_plan_by_hand() -> None:
    graph = captured("gpt-tiny")
    plan = Plan(world_size=2, name="by-hand")
    for node in graph.nodes:
        plan.replicate(node.name, 2)
        plan.assign_all(node.name, [0, 1])
    lin = first(graph, "aten.linear.default")
    plan.trans[lin.name] = []
    plan.split(lin.name, "n", 2)
    plan.assign(lin.name, (0,), 1).assign(lin.name, (1,), 0)
    validate(plan, graph, world_size=2)
    assert plan.device_of(lin.name, (1,)) == 0
    diff = plan.diff(resolve("dp", graph, 2))
    assert any(lin.name in line for line in diff)


def test_errors_name_the_op_and_rule() -> None:
    graph = captured("gpt-tiny")
    plan = resolve("dp", graph, 2)
    lin = first(graph, "aten.linear.default")
    sm = first(graph, "aten.layer_norm.default")
    plan.trans[lin.name] = []
    plan.split(lin.name, "n", 3)                # 64 % 3
    plan.assign_all(lin.name, [0, 1, 5])        # device out of range
    plan.trans[sm.name] = []
    plan.split(sm.name, "c", 2)                 # normalized dim is '^'
    plan.assign_all(sm.name, [0, 1])
    emb = first(graph, "aten.embedding.default")
    plan.assignment.pop(emb.name)               # unassigned
    with pytest.raises(PlanError) as info:
        validate(plan, graph, world_size=2)
    msg = str(info.value)
    assert "5 problems" in msg or "problems" in msg
    assert f"node {lin.name}" in msg and "64 % 3 != 0" in msg
    assert "device 5" in msg and "devices are 0..1" in msg
    assert "does not allow splitting 'c'" in msg and "a b c^" in msg
    assert f"node {emb.name}" in msg and "every piece is assigned" in msg


def test_world_size_mismatch_shows_the_arithmetic() -> None:
    graph = captured("gpt-tiny")
    plan = resolve("tp", graph, 4)
    with pytest.raises(PlanError) as info:
        validate(plan, graph, world_size=2)
    assert "4 != 2" in str(info.value)
    plan.mesh = Mesh.of(dp=3, tp=2)
    with pytest.raises(PlanError, match=r"dp\(3\) \* tp\(2\) = 6 != world_size\(4\)"):
        validate(plan, graph)


def test_order_cycles_are_rejected() -> None:
    graph = captured("gpt-tiny")
    plan = resolve("dp", graph, 2)
    a, b = graph.nodes[3].name, graph.nodes[4].name
    plan.order(PieceRef(a, (0,)), PieceRef(b, (0,))).order(PieceRef(b, (0,)), PieceRef(a, (0,)))
    with pytest.raises(PlanError, match="no cycle"):
        validate(plan, graph)


def test_table_and_layout_printing() -> None:
    from torchweave.policies import tp

    graph = captured("gpt-tiny")
    plan = tp(graph, 4, tp_size=2)
    out = io.StringIO()
    Console(file=out, width=200).print(plan_table(plan, graph, limit=12))
    text = out.getvalue()
    assert "op-trans" in text and "R×2" in text and "mesh dp=2×tp=2" in text
    mesh = Mesh.of(dp=2, tp=2)
    shard = Layout.of((8, 4), {r: Piece(((4 * (r // 2), 4 * (r // 2) + 4), (0, 4))) for r in range(4)})
    assert shard.describe(mesh) == "S(0)@dp"
    partial = Layout.of((8,), {r: Piece(((0, 8),), (r % 2, 2)) for r in range(4)})
    assert partial.describe(mesh) == "P@tp"


def test_a_gather_spans_only_the_devices_whose_pieces_a_reader_needs() -> None:
    """A batch split by dp and again by tp tiles it over every device of the stage; a reader
    that needs its dp share gathers over its tp group, not over every replica (before, one
    all-gather of the whole batch over all four devices, 2x the bytes, across replicas)."""
    from torchweave.lower.derive import Need, derive
    from torchweave.lower.steps import AllGather
    from torchweave.plan.layout import Piece

    src = {d: Piece(((2 * d, 2 * d + 2), (0, 4))) for d in range(4)}  # batch 8 in 4 pieces
    dst = {d: Need(((d // 2 * 4, d // 2 * 4 + 4), (0, 4)), d // 2) for d in range(4)}
    out = derive((8, 4), src, dst)
    (step,) = [s for s in out.steps if isinstance(s, AllGather)]
    assert set(step.groups) == {(0, 1), (2, 3)}
    assert all(out.result[d].box == dst[d].box for d in range(4))
    # a reader that needs the whole batch still gathers over all four
    whole = derive((8, 4), src, {d: Need(((0, 8), (0, 4)), 0) for d in range(4)})
    assert [s.groups for s in whole.steps if isinstance(s, AllGather)] == [((0, 1, 2, 3),)]
