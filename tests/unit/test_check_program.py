"""check_program: lowering's contract holds for real plans and each broken rule is named."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from tests.conftest import captured
from torchweave.lower.check import ProgramError, check_program
from torchweave.lower.lower import lower
from torchweave.lower.program import Comm, Compute
from torchweave.lower.steps import P2P
from torchweave.policies import resolve


def _lowered(plan: str, world: int = 2):
    graph = captured("gpt-tiny")
    return lower(graph, resolve(plan, graph, world))


@pytest.mark.parametrize("plan", ["dp", "zero3", "tp", "sp", "1f1b", "interleaved", "zb",
                                  "1f1b:tp=2"])
def test_lowered_plans_keep_the_contract(plan: str) -> None:
    world = 4 if ":" in plan or plan == "interleaved" else 2
    check_program(_lowered(plan, world))  # lower() runs it too; here it is the subject


def _broken(programs, rule: str) -> None:
    with pytest.raises(ProgramError) as info:
        check_program(programs)
    assert rule in str(info.value), str(info.value)


def test_a_name_read_before_it_is_defined() -> None:
    progs = copy.deepcopy(_lowered("tp"))
    instrs = progs[0].instrs
    first = next(i for i, ins in enumerate(instrs) if isinstance(ins, Compute) and ins.outputs)
    del instrs[first]
    _broken(progs, "is defined before use")


def test_a_collective_over_a_group_the_program_does_not_list() -> None:
    progs = copy.deepcopy(_lowered("tp"))
    at = next(i for i, ins in enumerate(progs[1].instrs)
              if isinstance(ins, Comm) and hasattr(ins.step, "groups"))
    ins = progs[1].instrs[at]
    progs[1].instrs[at] = replace(ins, step=replace(ins.step, groups=((1, 7),)))
    _broken(progs, "among the program's groups")


def test_ranks_out_of_order() -> None:
    progs = _lowered("dp")
    _broken(list(reversed(progs)), "programs are ranks 0..1 of 2, in order")


def test_a_segment_that_drops_an_instruction() -> None:
    progs = copy.deepcopy(_lowered("1f1b"))
    seg = progs[0].segments[0]
    seg.instrs = [i for i in seg.instrs if not isinstance(i, Compute)][:1] + \
        [i for i in seg.instrs if isinstance(i, Compute)][1:]
    _broken(progs, "segments hold each instruction")


def test_a_boundary_nobody_receives() -> None:
    progs = copy.deepcopy(_lowered("1f1b"))
    receiver = next(p for p in progs if any(s.recvs for s in p.segments))
    for seg in receiver.segments:
        seg.recvs = []
    _broken(progs, "its destination rank receives it")


def test_a_boundary_that_differs_between_ranks() -> None:
    progs = copy.deepcopy(_lowered("1f1b"))
    seg = next(s for p in progs for s in p.segments if s.recvs)
    b = seg.recvs[0]
    assert isinstance(b.step, P2P)
    seg.recvs[0] = replace(b, index=b.index + 99)
    _broken(progs, "the same on every rank it touches")


def test_later_passes_return_new_programs_and_leave_theirs_alone() -> None:
    """split_stages (and the messages it derives) make new Programs: the whole ones it was
    given stay as lowering left them, and the result is what lower() itself returns."""
    from torchweave.lower.stages import split_stages

    graph = captured("gpt-tiny")
    plan = resolve("1f1b:micro=2", graph, 2)
    whole = lower(graph, plan, stages=False)
    before = copy.deepcopy(whole)
    split = split_stages(whole, graph, plan)
    assert whole == before and all(not p.segments and not p.messages for p in whole)
    assert all(p.segments and p.messages and p.actions for p in split)
    staged = lower(graph, plan)
    assert [(p.segments, p.messages, p.actions) for p in split] == \
        [(p.segments, p.messages, p.actions) for p in staged]
    check_program(split)


def test_a_calls_reads_are_its_local_refs_in_pytree_order():
    """``Compute.reads`` walks plain containers itself and leaves the rest to pytree: the
    same names, in the same order, as ``pytree.tree_leaves`` gives, on nested and odd args."""
    from collections import namedtuple

    import torch.utils._pytree as pytree

    from torchweave.lower.program import Compute, LocalRef

    Pair = namedtuple("Pair", "a b")
    a, b, c, d = (LocalRef(n) for n in "abcd")
    cases = [
        ((a, 1, 2.0, None, "x"), {}),
        (([a, (b, [c])], torch.float32), {"k": d, "j": [a]}),
        ((Pair(a, (b, 3)), slice(0, 2)), {"dims": (1, 2), "t": Pair(c, d)}),
        ((), {}),
    ]
    for args, kwargs in cases:
        call = Compute("n", "aten.add.Tensor", args, kwargs, ("o",), "single")
        want = [x.name for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, LocalRef)]
        assert call.reads() == want
