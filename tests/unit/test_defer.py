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


def test_a_pipeline_moves_a_sum_read_on_its_own_stage() -> None:
    """The position table is looked up and read on stage 0: its sum over dp joins the
    gradient sync at the end of the step, not one all-reduce per micro-batch."""
    graph = captured("gpt-tiny")
    plan = resolve("1f1b:pp=2,dp=2,micro=2", graph, 4)
    progs = lower(graph, plan, stages=False)
    holders = [p for p in progs if "wpe.weight" in _summed(p)]
    stage0 = plan.pipeline.devices_of_stage(0)
    assert {p.rank for p in holders} == set(stage0)
    assert all(not _grad_all_reduces(p) and _summed(p)["wpe.weight"] == (tuple(stage0),)
               for p in holders)


class _PerBlock(nn.Module):
    """Four blocks, each looking up one shared table for itself (as a T5 block could make
    its relative-position bias): every stage reads the table, and a pipeline keeps a copy
    on each."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, self.table.weight)
        return x.pow(2).mean()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        pos = nn.functional.embedding(torch.arange(x.shape[1]), table)
        return x + self.proj(x + pos)


def test_per_block_lookups_of_one_table_move_their_sums_together() -> None:
    """Each stage's lookups move their sums over dp to the stage's copy of the table, and
    the copies' sum across stages takes them: one group of every holder."""
    torch.manual_seed(0)
    graph = torchweave.capture(_PerBlock(), (torch.randn(4, 8, 4),))
    plan = resolve("1f1b:pp=2,dp=2,micro=2", graph, 4)
    progs = lower(graph, plan, stages=False)
    assert all(not _grad_all_reduces(p) for p in progs)
    assert all(_summed(p)["table.weight"] == ((0, 1, 2, 3),) for p in progs)


@pytest.mark.parametrize("spec", ["tp", "sp", "1f1b:tp=2,pp=2,micro=2,split=sequence"])
def test_the_relative_position_bias_is_made_split_as_attention_reads_it(spec: str) -> None:
    """T5's bias comes from parameters alone, so no split reaches it going forward; attention
    split by heads reads its heads of it. Pulled back from those readers (plan/propagate.py),
    each rank looks up its heads' columns of the table: the bias is neither moved between
    ranks nor summed over them (before: whole on each rank and summed over tp in backward,
    or under sequence parallelism split along the keys and exchanged all-to-all)."""
    graph = captured("t5-tiny")
    plan = resolve(spec, graph, 4)
    batched = graph.batched_values()
    heads = graph.values[graph.node("embedding_1").outputs[0]].meta.shape[-1]
    for name in ("embedding_1", "embedding_3"):  # the encoder's and the decoder's table
        (trans,) = [t for t in plan.trans[name] if t.parts > 1 and t.dim]
        assert trans.parts == 2 if "pp" in spec else 4
    tables = []
    for prog in lower(graph, plan, stages=False):
        moved = [i for i in prog.instrs if isinstance(i, Comm) and i.value not in batched
                 and graph.values[i.value].kind == "activation"]
        assert not moved, [(i.value, i.step.NAME) for i in moved]
        tables += [s for s in prog.params if s.path.endswith("bias.embed.weight")]
    assert {s.path for s in tables} == {"enc_bias.embed.weight", "dec_bias.embed.weight"}
    assert all(s.box[1][1] - s.box[1][0] < heads for s in tables)


class _TwoSums(nn.Module):
    """One parameter behind two values that need different sums under ``tp``: one read by a
    tp-split op (summed over dp x tp), one by a tp-replicated op (over dp alone). Found in
    review: moved together to the parameter, the second's contribution counted tp times."""

    def __init__(self) -> None:
        super().__init__()
        self.P = nn.Parameter(torch.randn(8, 4))
        self.fc1 = nn.Linear(4, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x) * self.P.sum(-1, keepdim=True)
        return (self.fc2(h) + self.P * 2.0).pow(2).mean()


def test_values_summed_over_different_groups_keep_their_sums() -> None:
    torch.manual_seed(0)
    graph = torchweave.capture(_TwoSums(), (torch.randn(4, 8, 4),))
    for prog in lower(graph, resolve("tp:tp=2", graph, 4)):
        assert len(_grad_all_reduces(prog)) == 2 and _summed(prog)["P"] == ()
