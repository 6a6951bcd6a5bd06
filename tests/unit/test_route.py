"""Routed exchanges (``lower/route.py``): where a plan splits the experts of an op that
declares its routing index, lowering sends each token only where its experts are instead of
gathering every token; elsewhere the gather and reduce-scatter stay. The runtime's exchange
is checked against one process in tests/dist/test_comm.py, and the plans against one device
in tests/dist/test_hf_zoo.py."""

from __future__ import annotations

import math

import pytest
import torch

import torchweave
from tests.conftest import built
from torchweave.lower.lower import lower
from torchweave.lower.program import Comm, Compute
from torchweave.lower.steps import AllGather, Combine, Dispatch, ReduceScatter, Route, reach


def _experts_comms(programs, node="moe_experts"):
    """Per rank: the Comms that feed ``node`` or read its output, in program order."""
    out = []
    for prog in programs:
        call = next(i for i in prog.instrs if isinstance(i, Compute) and i.node == node)
        mine = [i for i in prog.instrs if isinstance(i, Comm)
                and (i.consumer == node or i.src in call.outputs)]
        out.append((prog, call, mine))
    return out


@pytest.fixture(scope="module")
def mixtral():
    pytest.importorskip("transformers")
    model, inputs = built("hf-mixtral-tiny")[:2]
    return torchweave.capture(model, inputs)


@pytest.mark.parametrize("spec, world", [("ep", 2), ("ep:ep=2", 4), ("ep", 4)])
def test_ep_routes_each_token_to_its_experts_instead_of_gathering_it(mixtral, spec, world):
    from torchweave.codegen.render import render
    from torchweave.policies import resolve

    programs = lower(mixtral, resolve(spec, mixtral, world))
    ep = 2 if spec == "ep:ep=2" else world
    experts = mixtral.values[[v for v in mixtral.values if "gate_up_proj" in v][0]].meta.shape[0]
    for prog, call, comms in _experts_comms(programs):
        kinds = [type(c.step) for c in comms]
        assert kinds == [Route, Dispatch, Dispatch, Combine], (prog.rank, kinds)
        route = comms[0]
        assert all(c.extra == (route.dst,) for c in comms[1:])
        # the op reads what the exchange delivers: the routed index and the dispatched rows
        assert set(call.reads()) >= {c.dst for c in comms[:3]}
        owners = route.step.owners
        assert len(owners) == ep and owners[0][0] == 0 and owners[-1][1] == experts
        assert all(a[1] == b[0] for a, b in zip(owners, owners[1:]))
        member = next(g for g in route.step.groups if prog.rank in g).index(prog.rank)
        assert call.kwargs["e0"] == owners[member][0]  # the piece computes the experts it owns
        code = render(prog)
        assert "C.route(rt.group_cache, " in code and "route=" + route.dst in code
        assert "all_gather for moe_experts" not in code


def test_layouts_that_are_not_the_pattern_keep_the_gather_and_reduce_scatter(mixtral):
    """ep=2 × tp=2 splits the experts over four devices while the tokens are gathered over
    two: a token's experts are not all within the gathering group, so no route."""
    from torchweave.policies import resolve

    for _, _, comms in _experts_comms(lower(mixtral, resolve("ep:ep=2,tp=2", mixtral, 4))):
        kinds = {type(c.step) for c in comms}
        assert AllGather in kinds and ReduceScatter in kinds
        assert not kinds & {Route, Dispatch, Combine}
    for _, _, comms in _experts_comms(lower(mixtral, resolve("dp", mixtral, 2))):
        assert not {type(c.step) for c in comms} & {Route, Dispatch, Combine}


def test_reach_is_the_members_a_row_reaches_on_average() -> None:
    """The simulator's bytes for a routed exchange: a row with ``k`` distinct experts out of
    ``E`` reaches each member with probability ``1 − C(E−E_m, k)/C(E, k)``; checked against
    drawn routings, and at its limits."""
    owners = tuple((m * 8, (m + 1) * 8) for m in range(8))  # 64 experts over 8 members
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([torch.randperm(64, generator=g)[:2] for _ in range(20000)])
    drawn = (draws // 8).sort(dim=1).values
    members = (1 + (drawn[:, 1] != drawn[:, 0]).long()).double().mean().item()
    assert reach(owners, 2) == pytest.approx(members, rel=0.01)
    assert reach(owners, 2) == pytest.approx(8 * (1 - math.comb(56, 2) / math.comb(64, 2)))
    assert reach(owners, 1) == pytest.approx(1.0)  # top-1: one member
    assert reach(owners, 64) == pytest.approx(8.0)  # every expert: every member
    assert reach(((0, 4),), 2) == pytest.approx(1.0)  # one member holds all
    step = Dispatch(((0, 1),), ((0, 2), (2, 4)), 2)
    assert step.out_bytes(600.0, 2) == pytest.approx(600.0 * 2 * (1 - 1 / 6))
    # the combine's source is sized as lowering sizes the op's output (every row of the
    # group); it returns each member's own rows and moves the routed ones, both ways
    back = Combine(((0, 1),), ((0, 2), (2, 4)), 2)
    assert back.out_bytes(1200.0, 2) == pytest.approx(600.0)
    assert back.forward_bytes(1200.0, 600.0) == pytest.approx(step.out_bytes(600.0, 2))
    assert back.backward_bytes(1200.0, 600.0) == pytest.approx(step.out_bytes(600.0, 2))


def test_the_simulator_prices_the_routed_exchange_below_the_gather(mixtral, monkeypatch):
    """The same ep plan simulated with the routed exchange and with the gather it replaces
    (the pass switched off): with 4 of 4 experts over 4 devices and top-2, a token reaches
    1.9 devices on average against 4, so less time in communication."""
    import torchweave.lower.lower as lowering
    from torchweave.policies import resolve
    from torchweave.sim import parse_cluster, simulate

    cluster = parse_cluster("4xA100-80GB-PCIe@4")
    plan = resolve("ep", mixtral, 4)
    routed = simulate(mixtral, plan, cluster)
    monkeypatch.setattr(lowering, "route_exchanges", lambda low: None)
    gathered = simulate(mixtral, plan, cluster)
    assert sum(routed.comm_time) < sum(gathered.comm_time)
