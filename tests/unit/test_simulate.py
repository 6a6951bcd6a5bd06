"""The event simulator over lowered Programs: time, comm, memory, timelines."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from tests.conftest import captured
from torchweave.errors import SimError
from torchweave.policies import resolve
from torchweave.sim import lookup, parse_cluster
from torchweave.sim.hardware.cluster import cluster_of
from torchweave.sim.simulate import simulate
from torchweave.sim.explain.trace import save_gantt_png, to_chrome_trace


def _sim(policy: str, n: int, cluster: str | None = None, **kw):
    g = captured("gpt-tiny")
    return simulate(g, resolve(policy, g, n), parse_cluster(cluster or f"{n}xA100-80GB-SXM"), **kw)


def test_dp_splits_compute_and_adds_comm() -> None:
    one, two, four = _sim("dp", 1), _sim("dp", 2), _sim("dp", 4)
    assert one.comm_time == (0.0,) and one.step_time > 0
    assert max(two.compute_time) < one.compute_time[0]
    assert max(four.compute_time) < max(two.compute_time)
    assert min(two.comm_time) > 0 and min(four.comm_time) > 0
    assert all(0 <= x <= 1 for x in two.idle)
    assert len(two.memory) == 2 and 0 < two.mfu < 1
    assert two.tokens_per_step == 4 * 16 and two.tokens_per_s > 0 and two.usd_per_million_tokens > 0
    # The gradient sync shows up as a bucketed all-reduce on every rank.
    assert {e.rank for e in two.timeline if "grads" in e.name} == {0, 1}


def test_tp_communicates_more_than_dp() -> None:
    dp, tp = _sim("dp", 2), _sim("tp", 2)
    assert sum(tp.comm_time) > sum(dp.comm_time)
    # tp shards the weights: fewer parameter bytes per rank than dp.
    assert tp.memory[0].params < dp.memory[0].params


def test_cross_node_all_reduce_is_slower() -> None:
    one_node = _sim("dp", 4, "4xA100-80GB-SXM")
    two_nodes = _sim("dp", 4, "4xA100-80GB-SXM@2")
    assert max(two_nodes.comm_time) > max(one_node.comm_time)
    assert two_nodes.step_time > one_node.step_time
    # Compute does not depend on the network.
    assert two_nodes.compute_time == pytest.approx(one_node.compute_time)


def test_chrome_trace_is_json_with_a_pid_per_rank(tmp_path) -> None:
    result = _sim("tp", 4)
    trace = json.loads(json.dumps(to_chrome_trace(result)))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    assert {e["tid"] for e in spans} == {0, 1}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(result.step_time * 1e6)


def test_gantt_png(tmp_path) -> None:
    # matplotlib is in the test extras: this test draws a chart, it never skips.
    import matplotlib.image

    path = save_gantt_png(_sim("dp", 2), tmp_path / "gantt.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 500
    # Bars in the compute (blue) and communication (orange) colors, not a blank canvas.
    rgb = pixels[..., :3].reshape(-1, 3)
    blue = ((rgb[:, 2] > 0.6) & (rgb[:, 0] < 0.3)).sum()
    orange = ((rgb[:, 0] > 0.9) & (rgb[:, 1] > 0.4) & (rgb[:, 1] < 0.6) & (rgb[:, 2] < 0.2)).sum()
    assert blue > 100 and orange > 10, (blue, orange)


def test_out_of_memory_is_reported_and_strict_raises() -> None:
    g = captured("gpt-tiny")
    small = dataclasses.replace(lookup("A100-80GB-SXM"), name="A100-1MiB", memory_bytes=2**20)
    cluster = cluster_of(small, 2)
    result = simulate(g, resolve("dp", g, 2), cluster)
    assert {o.rank for o in result.oom} == {0, 1}
    assert result.oom[0].peak > 2**20 and result.oom[0].contributors[0][1] >= result.oom[0].contributors[-1][1]
    assert "A100-1MiB" in str(result.oom[0])
    with pytest.raises(SimError) as exc:
        simulate(g, resolve("dp", g, 2), cluster, strict=True)
    text = str(exc.value)
    assert "A100-1MiB" in text and "out of memory" in text and "optimizer state" in text
    # The real device holds it.
    assert not _sim("dp", 2).oom


def test_plan_larger_than_cluster_is_an_error() -> None:
    g = captured("gpt-tiny")
    with pytest.raises(SimError, match="fit the cluster"):
        simulate(g, resolve("dp", g, 4), parse_cluster("2xA100-80GB-SXM"))


def test_zero_shards_state_and_bf16_is_faster() -> None:
    dp, z2, z3 = _sim("dp", 2), _sim("zero2", 2), _sim("zero3", 2)
    # The runtime's ZeRO-2: sharded AdamW state, stepped on the member's slice of the
    # pieces (no master copy); gradients sharded after backward (the full ones count as a
    # temporary).
    assert z2.memory[0].optimizer == dp.memory[0].optimizer // 2
    assert z2.memory[0].grads == dp.memory[0].grads // 2
    assert z2.memory[0].temporaries >= dp.memory[0].grads
    assert z3.memory[0].params < dp.memory[0].params
    assert sum(z3.comm_time) > sum(dp.comm_time)
    bf16 = _sim("dp", 2, dtype=torch.bfloat16)
    assert max(bf16.compute_time) < max(dp.compute_time)


def test_zero3_backward_prefetches_the_next_unit_before_the_reduce_scatter() -> None:
    """As runtime/zero3.py does: a unit's first use in backward starts the next unit's
    gather, so the gather is queued before this unit's reduce-scatter on the comm stream
    and the backward does not wait for both."""
    z3 = _sim("zero3", 2, timeline=True)
    comm = sorted((e for e in z3.timeline if e.rank == 0 and e.stream == "comm"),
                  key=lambda e: e.start)
    names = [e.name for e in comm]
    first_rs = next(i for i, n in enumerate(names) if n.startswith("reduce_scatter"))
    assert any("bwd (prefetch)" in n for n in names[:first_rs])
    # Every backward gather after the first reduce-scatter is a prefetch: none waits
    # until its unit is needed.
    assert all("(prefetch)" in n for n in names[first_rs:] if "all_gather unit" in n)


def test_gpt_small_dp64_is_fast() -> None:
    import torchweave
    from torchweave.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=8192, block_size=128, n_layer=10, n_head=8, d_model=256)  # gpt-small
    with torch.device("meta"):
        model = GPT(cfg)
        batch = (torch.empty(64, 128, dtype=torch.long), torch.empty(64, 128, dtype=torch.long))
    g = torchweave.capture(model, batch, name="gpt-small-b64")
    t0 = time.perf_counter()
    result = simulate(g, resolve("dp", g, 64), parse_cluster("64xA100-80GB-SXM"))
    elapsed = time.perf_counter() - t0
    assert result.world_size == 64 and result.step_time > 0
    assert elapsed < 10, f"simulating gpt-small dp on 64 ranks took {elapsed:.1f} s"


@pytest.mark.parametrize("seed", range(4))
def test_random_plans_simulate_without_deadlock(seed: int) -> None:
    """Random meshes, splits and device orders (point-to-point fallbacks included)."""
    from torchweave.policies import random_plan

    g = captured("gpt-tiny")
    result = simulate(g, random_plan(g, 4, seed=seed), parse_cluster("4xA100-80GB-SXM@2"))
    assert result.step_time > 0 and len(result.memory) == 4
