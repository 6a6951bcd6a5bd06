"""The step table in lower/steps.py is what codegen, the simulator and the runtime read."""

from __future__ import annotations

import inspect

import pytest

from torchweave.codegen.render import _comm_line
from torchweave.lower import steps
from torchweave.lower.program import Comm, Program
from torchweave.runtime import collectives
from torchweave.sim.hardware.collective_cost import Collective, collective_of

G = ((0, 1),)
COLLECTIVES = [
    steps.AllReduce(G), steps.AllReduce(G, bwd="all_reduce", op="lse"),
    steps.ReduceScatter(G, 1), steps.AllGather(G, 0), steps.AllGather(G, 2, bwd="reduce_scatter"),
    steps.Split(G, 1), steps.AllToAll(G, 0, 1), steps.GradAllReduce(G),
]


@pytest.mark.parametrize("step", COLLECTIVES, ids=repr)
def test_each_steps_runtime_function_exists_and_takes_its_arguments(step) -> None:
    fn, args, kwargs = step.runtime_call()
    target = getattr(collectives, fn)
    inspect.signature(target).bind("group_cache", "x", (0, 1), *args, **kwargs)


@pytest.mark.parametrize("step", COLLECTIVES + [steps.Narrow(((0, ((0, 1),)),)),
                                                steps.P2P((), ((0, (1,)),), ())], ids=repr)
def test_collectives_are_the_simulators_names(step) -> None:
    for name in (step.forward_collective(), step.backward_collective()):
        assert name is None or Collective(name)
    assert collective_of(step) == (None if step.forward_collective() is None
                                   else Collective(step.forward_collective()))


def test_the_backward_collective_follows_the_steps_mode() -> None:
    assert steps.AllReduce(G).backward_collective() is None
    assert steps.AllReduce(G, bwd="all_reduce").backward_collective() == "all_reduce"
    assert steps.AllGather(G, 0).backward_collective() is None
    assert steps.AllGather(G, 0, bwd="reduce_scatter").backward_collective() == "reduce_scatter"
    assert steps.Split(G, 0).backward_collective() == "all_gather"
    assert steps.GradAllReduce(G).forward_collective() is None


def test_generated_lines_read_the_table() -> None:
    prog = Program(rank=0, world_size=2, plan_name="p", groups=[(0, 1)])
    line = _comm_line(prog, Comm(steps.AllGather(G, 2, bwd="reduce_scatter"), "v", "x", "y"))
    assert line == "y = C.all_gather(rt.group_cache, x, (0, 1), 2, bwd='reduce_scatter')"
    line = _comm_line(prog, Comm(steps.AllReduce(G, op="lse"), "v", "x", "y"))
    assert line == "y = C.all_reduce_lse(rt.group_cache, x, (0, 1), bwd='identity')"
