"""The simulator prices sequence parallelism's regathered inputs as the runtime runs them
(runtime/regather.py): kept as the shard, gathered again in backward, once each."""

from __future__ import annotations

from tests.unit.test_sim_pipeline import _gpt_meta
from torchweave.lower import lower as lowering
from torchweave.policies import resolve
from torchweave.sim import parse_cluster, simulate


def _marked(graph, plan) -> list:
    return [c for c in lowering.lower(graph, plan)[0].comms() if getattr(c.step, "regather", False)]


def test_regathered_inputs_are_kept_as_shards_and_gathered_again(monkeypatch) -> None:
    g = _gpt_meta(layers=4)
    cluster = parse_cluster("2xA100-80GB-SXM")
    plan = resolve("sp", g, 2)
    again = _marked(g, plan)
    assert len(again) == 2 * 4 + 1  # attention and MLP inputs of each block, the head's
    on = simulate(g, plan, cluster)
    monkeypatch.setattr(lowering, "_regathers", lambda *a: False)
    assert not _marked(g, plan)
    off = simulate(g, plan, cluster)
    # each gathered input is held as its half instead of whole (it is saved by nothing else)
    full = sum(g.values[c.value].meta.nbytes for c in again)
    assert off.memory[0].activations - on.memory[0].activations == full // 2
    gathers = [e for e in on.timeline if e.rank == 0 and e.name.endswith(" again")]
    assert sorted(e.name for e in gathers) == sorted({e.name for e in gathers})  # once each
    assert len(gathers) == len(again)
    assert not [e for e in off.timeline if e.name.endswith(" again")]
    # the gathers overlap the backward they prefetch ahead of: little of them shows
    assert on.step_time < off.step_time + 0.5 * sum(e.end - e.start for e in gathers)
