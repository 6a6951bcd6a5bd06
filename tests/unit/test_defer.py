"""A replicated parameter-only value read by a batch-split op: its gradient sum moves to the parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchweave
from tests.conftest import captured
from torchweave.lower.lower import lower
from torchweave.lower.program import Comm
from torchweave.policies import resolve


def _grad_all_reduces(prog) -> list[Comm]:
    return [i for i in prog.instrs if isinstance(i, Comm) and i.step.NAME == "grad_all_reduce"]


def _summed(prog) -> dict[str, tuple]:
    return {s.path: s.grad_groups for s in prog.params}


@pytest.mark.parametrize("plan", ["dp", "zero3"])
def test_the_position_table_is_summed_with_the_other_gradients(plan: str) -> None:
    graph = captured("gpt-tiny")
    for prog in lower(graph, resolve(plan, graph, 2)):
        assert not _grad_all_reduces(prog)
        assert _summed(prog)["wpe.weight"] == ((0, 1),)


def test_tensor_parallel_is_unchanged() -> None:
    """Under tp the position table's reader is not split: there was nothing to move."""
    graph = captured("gpt-tiny")
    prog = lower(graph, resolve("tp", graph, 2))[0]
    assert _summed(prog)["wpe.weight"] == ()


class _Pos(nn.Module):
    """x + a position table looked up at arange; ``mixed`` also reads the table where its
    gradient is whole on every rank (a penalty on the table itself)."""

    def __init__(self, mixed: bool) -> None:
        super().__init__()
        self.table = nn.Embedding(8, 4)
        self.proj = nn.Linear(4, 4)
        self.mixed = mixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = self.table(torch.arange(x.shape[1]))
        out = self.proj(x + pos).pow(2).mean()
        if self.mixed:
            out = out + pos.pow(2).mean()
        return out


class _Nested(nn.Module):
    """The table read by a split op twice: once as it is, once through ``* 2`` (a value inside
    the cone of the second read, itself read outside it)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(8, 4)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pe = self.table(torch.arange(x.shape[1]))
        h = x + pe
        h = h + pe * 2
        return self.proj(h).pow(2).mean()


def test_an_inner_value_read_by_a_split_op_loses_its_sum_too() -> None:
    """Were the inner read's sum kept, the table's gradient would be summed there and again at
    the parameter: 4 where 3 is right (found in review)."""
    torch.manual_seed(0)
    graph = torchweave.capture(_Nested(), (torch.randn(4, 8, 4),))
    prog = lower(graph, resolve("dp", graph, 2))[0]
    assert not _grad_all_reduces(prog) and _summed(prog)["table.weight"] == ((0, 1),)


@pytest.mark.parametrize("mixed", [False, True])
def test_a_value_also_read_whole_keeps_its_sum_where_it_is_read(mixed: bool) -> None:
    torch.manual_seed(0)
    model, x = _Pos(mixed), torch.randn(4, 8, 4)
    graph = torchweave.capture(model, (x,))
    prog = lower(graph, resolve("dp", graph, 2))[0]
    if mixed:  # partial and whole contributions would mix in one gradient: not moved
        assert _grad_all_reduces(prog) and _summed(prog)["table.weight"] == ()
    else:
        assert not _grad_all_reduces(prog) and _summed(prog)["table.weight"] == ((0, 1),)


def test_a_pipeline_plan_keeps_its_sums_where_they_are_read() -> None:
    """Stages and their messages are built after lowering: pipelined plans are left as they were."""
    graph = captured("gpt-tiny")
    progs = lower(graph, resolve("1f1b:pp=2,dp=2", graph, 4), stages=False)
    holders = [p for p in progs if "wpe.weight" in _summed(p)]
    assert holders and all(_grad_all_reduces(p) and _summed(p)["wpe.weight"] == () for p in holders)
