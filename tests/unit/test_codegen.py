"""Generated code: readable, and it runs (round trip on one process, no groups)."""

from __future__ import annotations

import ast

import torch

from tests.conftest import built, captured, state_of
from torchweave.codegen.render import render, write
from torchweave.lower.lower import lower
from torchweave.policies import resolve
from torchweave.runtime.executor import RankModule
from torchweave.runtime.groups import GroupCache


def test_header_and_one_op_per_line() -> None:
    graph = captured("gpt-tiny")
    programs = lower(graph, resolve("tp", graph, 2))
    src = render(programs[1])
    ast.parse(src)
    head = src.split('"""')[1]
    assert "plan 'tp', rank 1 of 2" in head and "Groups with this rank: g0=(0, 1)" in head
    body = [line for line in src.splitlines() if line.startswith("    ") and " = " in line
            and not line.strip().startswith("p_")]
    assert body and all(line.count(" = ") == 1 for line in body)
    commented = [line for line in body if "aten." in line]
    assert all("  # (" in line for line in commented), "every op line has a shape comment"
    assert any("C.all_reduce(rt.group_cache" in line for line in body)


def test_round_trip_renders_runs_and_matches(tmp_path) -> None:
    """A one-device plan's code, run by the executor, gives the model's loss and grads."""
    model, inputs = built("llama-tiny")[:2]
    graph = captured("llama-tiny")
    plan = resolve("dp", graph, 1)
    (path,) = write(lower(graph, plan), str(tmp_path))
    state = {k: v.detach() for k, v in state_of(model).items()}
    group_cache = GroupCache(rank=0, world_size=1, timeout_s=5.0, device=torch.device("cpu"))
    module = RankModule(lower(graph, plan)[0], path, state, group_cache)
    loss = module.backward_step(*inputs)
    model.zero_grad()
    want = model(*inputs)
    want.backward()
    assert abs(loss - float(want.detach())) < 1e-6
    for p, t in model.named_parameters():
        torch.testing.assert_close(module.params[p].grad, t.grad, rtol=1e-5, atol=1e-7)
