"""Co-shard composed with data, tensor and pipeline parallelism matches one device
(real gloo ranks): each device runs its share of a region in chunks."""

from __future__ import annotations

import functools

import pytest

from tests.conftest import built
from torchweave.api import capture
from torchweave.lower.lower import lower
from torchweave.policies import resolve
from torchweave.verify import Case, verify_many

CASES = {
    2: [("gpt-tiny", "dp:coshard=2"), ("gpt-tiny", "tp:tp=2,coshard=mlp:2"),
        ("gpt-tiny", "zero3:coshard=attn:2"), ("llama-tiny", "sp:tp=2,coshard=2"),
        ("hf-gpt2-tiny", "dp:coshard=2")],
    4: [("gpt-tiny", "1f1b:tp=2,micro=2,coshard=mlp:2"), ("gpt-tiny", "tp:tp=2,dp=2,zero=1,coshard=2")],
}


@functools.lru_cache(maxsize=None)
def reports(world_size: int) -> dict[tuple[str, str], object]:
    cases, keys = [], []
    for name, plan in CASES[world_size]:
        try:
            model, inputs = built(name)[:2]
        except pytest.skip.Exception:
            continue
        cases.append(Case(model, inputs, plan, steps=2, name=f"{name}/{plan}"))
        keys.append((name, plan))
    return dict(zip(keys, verify_many(cases, world_size=world_size)))


@pytest.mark.dist
@pytest.mark.parametrize("world_size,name,plan", [(w, n, p) for w, cs in CASES.items() for n, p in cs])
def test_coshard_composes_and_matches_one_device(world_size: int, name: str, plan: str) -> None:
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    model, inputs = built(name)[:2]
    graph = capture(model, inputs)
    programs = lower(graph, resolve(plan, graph, world_size))
    chunked = [sum(1 for ins in p.instrs if getattr(ins, "chunk", None) is not None) for p in programs]
    assert all(chunked), f"every rank runs co-shard chunks: {chunked}"
    report = reports(world_size)[(name, plan)]
    assert report.ok, str(report)
    assert len(report.losses) == 2 and report.grads and report.params
