"""What every rank lowers under ``shared_front`` (rank 0's graph through the graph-file format,
its plan through plan JSON) writes the same code as rank 0's own capture and plan: the
format drops nothing that lowering or codegen reads."""

from __future__ import annotations

import pytest

from tests.conftest import built
from torchweave.graphfile import graph_from_json, graph_to_json
from torchweave.parallel import capture_and_resolve, compile_plan
from torchweave.plan.plan import Plan

CASES = [("gpt-tiny", "dp"), ("gpt-tiny", "tp"), ("gpt-tiny", "zero3"),
         ("gpt-tiny", "1f1b:pp=2,micro=2"), ("gpt-tiny", "interleaved:pp=2,virtual=2,micro=2"),
         ("gpt-tiny", "zb:pp=2,micro=2"), ("llama-tiny", "sp"), ("t5-tiny", "dp"),
         ("moe-tiny", "ep"), ("recycler-tiny", "1f1b:pp=2,micro=2"),
         ("gpt-tiny", "tp:tp=2,recompute=full")]


@pytest.mark.parametrize("name,plan", CASES, ids=[f"{m}-{p}" for m, p in CASES])
def test_the_sent_graph_and_plan_write_rank_0s_code(name: str, plan: str, tmp_path) -> None:
    model, inputs = built(name)[:2]
    graph, resolved = capture_and_resolve(model, inputs, plan, world_size=2)
    own = compile_plan(model, inputs, plan, world_size=2, code_dir=str(tmp_path / "own"),
                       front=(graph, resolved))
    sent = graph_from_json(graph_to_json(graph))
    sent.meta["constants"] = graph.meta.get("constants", {})  # they travel as tensors
    got = compile_plan(model, inputs, plan, world_size=2, code_dir=str(tmp_path / "sent"),
                       front=(sent, Plan.from_json(resolved.to_json())))
    for a, b in zip(own.code_paths, got.code_paths):
        with open(a) as fa, open(b) as fb:
            assert fa.read() == fb.read(), f"{name} under {plan}: {a} and {b} differ"
    assert own.plan.to_json() == got.plan.to_json()
