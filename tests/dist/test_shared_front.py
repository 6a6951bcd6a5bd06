"""Rank 0 captures and plans for every rank (``shared_front``), in a forked child: the other
ranks never run torch.export, rank 0 keeps none of what it imports, every rank still trains as
one device does, and hears of rank 0's errors instead of waiting."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

from tests.conftest import built
from torchweave.runtime.launch import LaunchConfig, spawn


def _one_step(ctx, model, inputs, plan: str, refuse_graph: bool, in_process: bool = False):
    import torchweave.front as F
    import torchweave.parallel as P

    captures = []
    real = F._capture_once

    def counted(*args, **kwargs):
        captures.append(1)
        return real(*args, **kwargs)

    F._capture_once = counted
    if in_process:
        os.environ["TORCHWEAVE_CAPTURE_IN_PROCESS"] = "1"
    if refuse_graph and ctx.rank == 0:  # a graph the file format cannot hold: each rank captures
        def refuse(graph):
            raise ValueError("not in the format")
        F.graph_to_json = refuse
    pm = P.parallelize(copy.deepcopy(model), inputs, plan=plan, groups=ctx.groups)
    loss = pm.train_step(*inputs)
    from torchweave.runtime.forked import can_fork

    return len(captures), float(loss), "networkx" in sys.modules, can_fork()


@pytest.mark.dist
@pytest.mark.parametrize("plan,refuse,in_process", [
    ("dp", False, False), ("1f1b:pp=2,micro=2", False, False), ("tp", True, False),
    ("dp", False, True)])
def test_only_rank_0_captures_and_every_rank_trains_as_one_device(plan, refuse, in_process) -> None:
    model, inputs = built("gpt-tiny")[:2]
    want = float(copy.deepcopy(model)(*inputs).detach())
    results = spawn(_one_step, LaunchConfig(world_size=2, timeout_s=60.0), model, inputs, plan,
                    refuse, in_process)
    counts = [c for c, _, _, _ in results]
    imported = [x for _, _, x, _ in results]
    forks = results[0][3]  # whether rank 0 could fork, as rank 0 saw it
    if refuse:
        assert counts[1] >= 1, "rank 0 sent no graph: rank 1 captures for itself"
        assert counts[0] >= 1, "rank 0's child could not send it either: rank 0 captured itself"
    else:
        assert counts[1] == 0, f"rank 1 captured {counts[1]} time(s)"
        if forks and not in_process:  # rank 0's child captured: rank 0 neither captured nor imported torch.export's
            assert counts[0] == 0 and not imported[0], (counts, imported)
        else:
            assert counts[0] >= 1
        assert not imported[1]
    for _, loss, _, _ in results:
        if loss == loss:  # a pipeline's non-last rank may report no loss
            assert abs(loss - want) < 1e-5 * max(1.0, abs(want))


def _bad_plan(ctx, model, inputs):
    import torchweave
    from torchweave.errors import TorchweaveError

    try:
        torchweave.parallelize(model, inputs, plan="1f1b:pp=2,micro=3", groups=ctx.groups)
    except TorchweaveError as e:
        return str(e)
    return "no error"


@pytest.mark.dist
def test_an_error_on_rank_0_reaches_every_rank() -> None:
    """A batch of 4 does not split into 3 micro-batches: rank 0's capture says so, and rank 1
    raises too, naming rank 0, instead of waiting for a graph that never comes."""
    model, inputs = built("gpt-tiny")[:2]
    first, second = spawn(_bad_plan, LaunchConfig(world_size=2, timeout_s=30.0), model, inputs)
    assert "micro-batches" in first
    assert "rank 0's capture and plan" in second and "micro-batches" in second


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = torch.tensor([1.0, 2.0, 3.0, 4.0])  # neither parameter nor buffer
        self.keep = torch.tensor([1, 0, 1, 1], dtype=torch.int16)  # a dtype gloo cannot send
        self.none = torch.zeros(0, 4)  # no bytes at all

    def forward(self, x):
        return (self.lin(x) * self.scale * self.keep).pow(2).mean() + self.none.sum()


@pytest.mark.dist
def test_constants_reach_every_rank() -> None:
    """Lifted constants (plain tensor attributes read in forward) travel as bytes, whatever
    their dtype (gloo has no int16 broadcast), an empty one too."""
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(4, 4)
    want = float(copy.deepcopy(model)(x).detach())
    results = spawn(_one_step, LaunchConfig(world_size=2, timeout_s=60.0), model, (x,), "dp", False)
    assert results[1][0] == 0
    for _, loss, _, _ in results:
        assert abs(loss - want) < 1e-6
