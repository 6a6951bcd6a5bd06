"""A mean loss stays each rank's term: no sum over ranks of its numerator in forward
(torchweave/lower/loss.py). Equivalence with one device under every policy is
tests/dist/test_policies.py's; here, what lowering emits."""

from __future__ import annotations

import torch
import torch.nn as nn

import torchweave
from tests.conftest import captured
from torchweave.lower.lower import lower
from torchweave.lower.program import Comm, Compute
from torchweave.policies import resolve


def _all_reduces(prog) -> list[Comm]:
    return [i for i in prog.instrs if isinstance(i, Comm) and i.step.NAME == "all_reduce"]


def test_data_parallel_cross_entropy_sums_nothing_in_forward() -> None:
    graph = captured("gpt-tiny")
    for prog in lower(graph, resolve("dp", graph, 2)):
        assert not _all_reduces(prog)
        assert prog.loss == "cross_entropy_loss"
        assert prog.loss_partial == (prog.rank, 2) and prog.loss_group == (0, 1)
        # the count of targets: from the whole targets, on each rank; the partial count is gone
        (div,) = [i for i in prog.instrs if isinstance(i, Compute) and i.outputs == ("cross_entropy_loss",)]
        assert [a.name for a in div.args] == ["cross_entropy_loss_sum", "cross_entropy_loss_count_whole"]
        whole = [i for i in prog.instrs if isinstance(i, Compute) and i.aux
                 and i.outputs[0].endswith("_whole")]
        assert [i.fn for i in whole] == ["aten.flatten.using_ints", "aten.ne.Scalar", "aten.sum.default"]
        assert whole[0].args[0].name == "targets"
        assert not [i for i in prog.instrs if isinstance(i, Compute)
                    and i.outputs == ("cross_entropy_loss_count",)]


def test_pipeline_and_data_parallel_keep_the_term_on_the_last_stage() -> None:
    graph = captured("gpt-tiny")
    progs = lower(graph, resolve("1f1b:dp=2,micro=2", graph, 4))
    holders = [p for p in progs if p.loss is not None]
    assert len(holders) == 2
    for prog in holders:
        assert not _all_reduces(prog)
        assert prog.loss_partial[1] == 2 and prog.loss_group == tuple(p.rank for p in holders)


class _EarlyTargets(nn.Module):
    """The targets are flattened first thing: in a pipeline, on the first stage."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(-1)
        return nn.functional.cross_entropy(self.layers(x).reshape(-1, 16), t)


def test_a_count_runs_in_the_stage_that_reads_it() -> None:
    x, t = torch.randn(4, 2, 16), torch.randint(0, 16, (4, 2))
    graph = torchweave.capture(_EarlyTargets(), (x, t))
    plan = resolve("1f1b:pp=2,dp=2,micro=2", graph, 4)
    first = {n for n, s in plan.pipeline.stage_of.items() if s == 0}
    assert any(n.target == "aten.reshape.default" and n.input_refs()[0].name == "t"
               and n.name in first for n in graph.nodes)
    for prog in lower(graph, plan):  # split into stages: each count in the loss's stage
        whole = [i for seg in prog.segments for i in seg.instrs
                 if isinstance(i, Compute) and i.outputs[0].endswith("_whole")]
        assert len(whole) == (3 if prog.loss is not None else 0)
        assert not _all_reduces(prog)


def test_a_loss_held_whole_is_unchanged() -> None:
    """Under tp the batch is whole on every rank: the numerator is not partial, nothing moves."""
    graph = captured("gpt-tiny")
    for prog in lower(graph, resolve("tp", graph, 2)):
        assert prog.loss_partial == (0, 1) and prog.loss_group is None


class _Reused(nn.Module):
    """The numerator is read by the denominator too: its sum must stay."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits = self.proj(x)
        total = nn.functional.cross_entropy(logits, t, reduction="sum")
        return total / ((t >= 0).sum() + 1e-3 * total)


def test_a_numerator_read_elsewhere_keeps_its_sum() -> None:
    x, t = torch.randn(8, 4), torch.randint(0, 8, (8,))
    graph = torchweave.capture(_Reused(), (x, t))
    progs = lower(graph, resolve("dp", graph, 2))
    assert all(p.loss_partial == (0, 1) for p in progs)
    assert any(i.step.NAME == "all_reduce" for p in progs for i in p.instrs if isinstance(i, Comm))


class _Masked(nn.Module):
    """A mean over a float mask: the mask's sum is a float of the input, summed over ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        err = self.proj(x).squeeze(-1).pow(2)
        return (err * mask).sum() / mask.sum()


def test_a_float_count_is_still_summed_and_the_loss_kept_partial() -> None:
    x, mask = torch.randn(8, 4), (torch.arange(8) % 3 != 0).float()
    graph = torchweave.capture(_Masked(), (x, mask))
    for prog in lower(graph, resolve("dp", graph, 2)):
        (comm,) = _all_reduces(prog)
        assert graph.values[comm.value].meta.dtype == torch.float32
        assert prog.loss_partial == (prog.rank, 2)


class _LearnedScale(nn.Module):
    """The denominator is a parameter: its gradient needs every rank's numerator."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 1)
        self.temp = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).pow(2).sum() / self.temp


class _RandomMask(nn.Module):
    """Positions counted by a mask drawn in the model: the count must be of this rank's draw."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        per = nn.functional.cross_entropy(self.proj(x), t, reduction="none")
        keep = torch.rand_like(t, dtype=torch.float) < 0.5
        return (per * keep).sum() / keep.sum()


class _PerPosition(nn.Module):
    """A count per position: a vector, which a plan may leave sharded after its sum."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        valid = t != -100
        count = valid.sum(0)
        per = nn.functional.cross_entropy(self.proj(x).transpose(1, 2), t, reduction="none")
        return ((per * valid).sum(0) / count.clamp(min=1)).sum()


class _NamedLikeAWholeCount(nn.Module):
    """An input named as a whole count's local name would be."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor, t: torch.Tensor, ne_whole: torch.Tensor) -> torch.Tensor:
        n = (t != -100).sum()
        return nn.functional.cross_entropy(self.proj(x) / n * ne_whole, t)


def test_a_denominator_with_a_gradient_keeps_the_sum() -> None:
    graph = torchweave.capture(_LearnedScale(), (torch.randn(8, 4),))
    for prog in lower(graph, resolve("dp", graph, 2)):
        assert prog.loss_partial == (0, 1) and len(_all_reduces(prog)) == 1


def test_a_random_count_is_summed_not_drawn_again() -> None:
    graph = torchweave.capture(_RandomMask(), (torch.randn(8, 4), torch.randint(0, 8, (8,))))
    for prog in lower(graph, resolve("dp", graph, 2)):
        assert not [i for i in prog.instrs if isinstance(i, Compute) and i.aux
                    and "rand" in i.fn]
        assert len(_all_reduces(prog)) == 1


def test_a_sum_that_another_step_follows_is_kept() -> None:
    """Seeds whose plans sum the count into a shard and then gather or send it on: the
    steps after the sum expect the shard, so the sum stays."""
    from torchweave.policies.random import random_plan

    graph = torchweave.capture(_PerPosition(), (torch.randn(4, 4, 8), torch.randint(0, 8, (4, 4))))
    for seed in (9, 38):
        for prog in lower(graph, random_plan(graph, 4, seed=seed)):
            after = {i.src for i in prog.instrs if isinstance(i, Comm)}
            sums = [i for i in _all_reduces(prog) if i.value == "sum_1"]  # the count
            assert graph.values["sum_1"].meta.dtype == torch.int64
            assert sums and all(i.dst in after for i in sums), (seed, prog.rank)
            assert not [i for i in prog.instrs if isinstance(i, Compute) and i.aux
                        and i.outputs[0].startswith("sum_1_whole")]


def test_whole_count_names_avoid_the_graph_s_names() -> None:
    x, t, s = torch.randn(8, 4), torch.randint(0, 8, (8,)), torch.randn(8, 1)
    graph = torchweave.capture(_NamedLikeAWholeCount(), (x, t, s))
    for prog in lower(graph, resolve("dp", graph, 2)):
        made = [o for i in prog.instrs if isinstance(i, Compute) for o in i.outputs]
        assert "ne_whole" not in made and len(made) == len(set(made))
        assert any(o.startswith("ne_whole") for o in made)
