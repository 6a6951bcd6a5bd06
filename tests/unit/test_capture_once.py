"""A pipeline plan string says its micro-batch count before capture: ``capture_and_resolve``
captures one micro-batch once and builds the plan on it, the very graph and plan that
capturing the whole batch, planning, then capturing a micro-batch and planning again gave."""

from __future__ import annotations

import pytest

import torchweave.front as P
from tests.conftest import built
from torchweave.graphfile import graph_to_json
from torchweave.policies import resolve
from torchweave.policies.spec import micro_of

CASES = [("gpt-tiny", "1f1b:pp=2,micro=2", 2), ("gpt-tiny", "1f1b", 2), ("gpt-tiny", "gpipe:pp=2", 2),
         ("gpt-tiny", "interleaved:pp=2,virtual=2,micro=2", 2), ("gpt-tiny", "zb:pp=2,dp=2,micro=2", 4),
         ("gpt-tiny", "1f1b:tp=2,micro=4", 4), ("gpt-tiny", "interlaced:micro=2", 2),
         ("recycler-tiny", "1f1b:pp=2,micro=2", 2), ("llama-tiny", "1f1b:pp=2,micro=2,recompute=full", 2)]


@pytest.mark.parametrize("name,plan,world", CASES, ids=[f"{m}-{p}-{w}" for m, p, w in CASES])
def test_one_capture_gives_the_two_capture_graph_and_plan(name, plan, world, monkeypatch) -> None:
    model, inputs = built(name)[:2]
    calls = []
    real = P._capture_once
    monkeypatch.setattr(P, "_capture_once", lambda *a: calls.append(a[2]) or real(*a))
    graph, got = P.capture_and_resolve(model, inputs, plan, world_size=world)
    assert len(calls) == 1 and calls[0] > 1, f"captures of {calls} micro-batches"
    first = resolve(plan, real(model, inputs, 1, "fp32"), world)
    m = first.pipeline.micro_batches
    assert micro_of(plan, world) == m
    again = real(model, inputs, m, "fp32")
    assert got.to_json() == resolve(plan, again, world).to_json()
    assert graph_to_json(graph) == graph_to_json(again)


def test_what_says_no_count_is_captured_as_before() -> None:
    assert micro_of("dp", 2) is None and micro_of("tp:tp=2", 2) is None
    assert micro_of("1f1b:pp=2", 4) == 4 and micro_of("1f1b:tp=2", 4) == 4
    assert micro_of("interlaced", 3) == 6 and micro_of("zb:pp=2,micro=6", 4) == 6
