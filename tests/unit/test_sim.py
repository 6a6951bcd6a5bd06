"""Device catalog, clusters, and the cost model (compute, communication, memory)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import captured
from torchweave.errors import SimError
from torchweave.ops import info
from torchweave.sim import (
    CATALOG, Algorithm, Cluster, Collective, ComputeModel, Link, cluster_of, collective_options,
    collective_time, dtype_of, dump_cluster_yaml, load_cluster_yaml, lookup, model_state_memory,
    op_time, parse_cluster,
)
from torchweave.policies import resolve
from torchweave.sim.hardware.cluster import cluster_from_dict, cluster_to_dict
from torchweave.sim.simulate import simulate

REQUIRED = ["V100-32GB-SXM2", "A100-40GB-SXM", "A100-80GB-SXM", "A100-80GB-PCIe", "H100-80GB-SXM",
            "H200-141GB-SXM", "RTX3090", "RTX3090-NVLink", "RTX4090", "MI250", "CPU-2core"]
MiB = 2**20


# --- catalog ----------------------------------------------------------------

def test_catalog_has_every_required_device() -> None:
    assert set(REQUIRED) <= set(CATALOG)


@pytest.mark.parametrize("name", REQUIRED)
def test_catalog_entry_positive_and_sourced(name: str) -> None:
    d = CATALOG[name]
    numbers = [d.memory_bytes, d.memory_bandwidth, d.node_size, d.price_per_hour, d.peak.fp32,
               d.intra.bandwidth, d.intra.latency, d.inter.bandwidth, d.inter.latency]
    numbers += [v for v in dataclasses.astuple(d.peak) if v is not None]
    assert all(v > 0 for v in numbers), d
    assert d.sources and all(isinstance(s, str) and s for s in d.sources)
    assert d.intra.kind and d.inter.kind
    # Matrix precisions are never slower than fp32; the network never beats the node's links.
    assert all(v >= d.peak.fp32 for v in dataclasses.astuple(d.peak) if v is not None)
    assert d.inter.bandwidth <= d.intra.bandwidth


def test_catalog_published_numbers() -> None:
    # Dense datasheet figures (not "with sparsity").
    assert CATALOG["A100-80GB-SXM"].peak.bf16 == 312e12
    assert CATALOG["H100-80GB-SXM"].peak.bf16 == pytest.approx(989.4e12)
    assert CATALOG["V100-32GB-SXM2"].peak.bf16 is None
    assert CATALOG["RTX3090-NVLink"].intra.bandwidth > CATALOG["RTX3090"].intra.bandwidth
    assert CATALOG["H200-141GB-SXM"].memory_bytes > CATALOG["H100-80GB-SXM"].memory_bytes


def test_catalog_is_frozen() -> None:
    with pytest.raises(TypeError):
        CATALOG["X"] = CATALOG["RTX4090"]  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        CATALOG["RTX4090"].price_per_hour = 0.0  # type: ignore[misc]


def test_bad_device_names_every_field() -> None:
    with pytest.raises(SimError) as err:
        dataclasses.replace(CATALOG["RTX4090"], memory_bandwidth=0, price_per_hour=-1, sources=())
    msg = str(err.value)
    assert "memory_bandwidth" in msg and "price_per_hour" in msg and "sources" in msg
    assert len(err.value.problems) == 3


# --- clusters ---------------------------------------------------------------

def test_parse_cluster() -> None:
    c = parse_cluster("64xA100-80GB-SXM")
    assert (c.nodes, c.devices_per_node, c.size) == (8, 8, 64)
    assert c.device is CATALOG["A100-80GB-SXM"] and c.intra == c.device.intra
    assert c.price_per_hour == pytest.approx(64 * c.device.price_per_hour)
    c = parse_cluster("16xh100-80gb-sxm@4")
    assert (c.nodes, c.devices_per_node) == (4, 4)
    assert parse_cluster("2xA100-80GB-SXM").nodes == 1  # fewer than a node: one node
    assert parse_cluster("4xRTX3090-NVLink").nodes == 2  # bridged pairs
    assert c.node_of(0) == 0 and c.node_of(15) == 3


def test_parse_cluster_errors() -> None:
    with pytest.raises(SimError, match="did you mean 'A100-80GB-SXM'"):
        parse_cluster("8xA100-80GB-SMX")
    with pytest.raises(SimError, match=r"N x DEVICE"):
        parse_cluster("A100 times eight")
    with pytest.raises(SimError, match=r"12 % 8 = 4 != 0"):
        parse_cluster("12xH100-80GB-SXM")
    with pytest.raises(SimError, match="nodes"):
        Cluster(device=CATALOG["MI250"], nodes=0, devices_per_node=8, intra=CATALOG["MI250"].intra,
                inter=CATALOG["MI250"].inter)


def test_cluster_yaml(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("name: lab\ndevice: A100-80GB-SXM\nnodes: 2\ndevices_per_node: 4\n"
                    "inter: {bandwidth: 12.5e9}\n")
    c = load_cluster_yaml(path)
    assert (c.name, c.size, c.devices_per_node) == ("lab", 8, 4)
    assert c.inter.bandwidth == 12.5e9 and c.inter.latency == c.device.inter.latency

    path.write_text("device: {base: RTX4090, name: my-4090, peak: {bf16: 1.5e+14}}\nnodes: 1\n")
    c = load_cluster_yaml(path)
    assert c.device.name == "my-4090" and c.device.peak.bf16 == 1.5e14
    assert c.device.peak.fp32 == CATALOG["RTX4090"].peak.fp32 and c.devices_per_node == 8


def test_cluster_yaml_round_trip(tmp_path) -> None:
    c = parse_cluster("16xMI250")
    path = tmp_path / "c.yaml"
    path.write_text(dump_cluster_yaml(c))
    assert load_cluster_yaml(path) == c


def test_cluster_yaml_errors(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("device: [unclosed\nnodes: 2\n")
    with pytest.raises(SimError, match="not valid YAML"):
        load_cluster_yaml(path)

    path.write_text("device: B200\nnodes: 2\n")
    with pytest.raises(SimError, match=r"c.yaml: device: 'B200'\n  rule: must be one of: V100"):
        load_cluster_yaml(path)

    # Every problem at once: unknown field (with a suggestion), wrong types, a bad enum.
    path.write_text("device: {base: RTX4090, rates: guessed, peak: {bf16: fast}}\n"
                    "nodes: two\ndevice_per_node: 4\nintra: {bandwith: 1}\n")
    with pytest.raises(SimError) as err:
        load_cluster_yaml(path)
    msg, objs = str(err.value), [p.obj for p in err.value.problems]
    assert "c.yaml: device_per_node" in objs and "did you mean 'devices_per_node'" in msg
    assert "c.yaml: intra: bandwith" in objs and "allowed fields: bandwidth, latency, kind" in msg
    assert "c.yaml: nodes" in objs and "must be a number (int)" in msg
    assert "c.yaml: device.peak.bf16" in objs
    assert "c.yaml: device.rates" in objs and "must be one of: datasheet, measured" in msg

    path.write_text("device: {name: mine}\nnodes: 1\n")
    with pytest.raises(SimError, match="device.peak: missing"):
        load_cluster_yaml(path)


# --- communication ----------------------------------------------------------

def test_ring_vs_tree_crossover() -> None:
    c = parse_cluster("1024xA100-80GB-SXM")
    group = range(0, 1024, 8)  # one rank per node: 128 ranks, all on the network
    small = collective_options(c, Collective.ALL_REDUCE, 1024, group)
    large = collective_options(c, Collective.ALL_REDUCE, 1024 * MiB, group)
    assert small[0].algorithm is Algorithm.TREE
    assert large[0].algorithm is Algorithm.RING
    # The formulas themselves: ring = 2(p-1)/p B/bw + 2(p-1)a; tree = 2 log2(p) (a + B/bw).
    ring = collective_time(c, Collective.ALL_REDUCE, 1024 * MiB, group, algorithm=Algorithm.RING)
    bw, a, p, b = c.inter.bandwidth, c.inter.latency, 128, 1024 * MiB
    assert ring.seconds == pytest.approx(2 * (p - 1) / p * b / bw + 2 * (p - 1) * a)
    tree = collective_time(c, Collective.ALL_REDUCE, 1024, group, algorithm=Algorithm.TREE)
    assert tree.seconds == pytest.approx(2 * 7 * (a + 1024 / bw))


def test_hierarchical_slower_across_nodes_than_within() -> None:
    c = parse_cluster("16xH100-80GB-SXM")
    within = collective_time(c, Collective.ALL_REDUCE, 256 * MiB, range(8))
    across = collective_time(c, Collective.ALL_REDUCE, 256 * MiB, [0, 1, 2, 3, 8, 9, 10, 11])
    assert within.nodes == 1 and across.nodes == 2
    assert across.algorithm is Algorithm.HIERARCHICAL
    assert across.seconds > within.seconds
    # Hierarchy beats a flat ring at the network's rate.
    flat = collective_time(c, Collective.ALL_REDUCE, 256 * MiB, [0, 1, 2, 3, 8, 9, 10, 11],
                           algorithm=Algorithm.RING)
    assert across.seconds < flat.seconds


@pytest.mark.parametrize("coll", [Collective.ALL_GATHER, Collective.REDUCE_SCATTER,
                                  Collective.ALL_TO_ALL, Collective.BROADCAST])
def test_collectives_cost_more_across_nodes(coll: Collective) -> None:
    c = parse_cluster("16xA100-80GB-SXM")
    within = collective_time(c, coll, 64 * MiB, range(8)).seconds
    across = collective_time(c, coll, 64 * MiB, [0, 1, 2, 3, 8, 9, 10, 11]).seconds
    assert 0 < within < across


def test_p2p_and_trivial_groups() -> None:
    c = parse_cluster("16xA100-80GB-SXM")
    near = collective_time(c, Collective.P2P, 8 * MiB, (0, 1))
    far = collective_time(c, Collective.P2P, 8 * MiB, (0, 8))
    assert near.seconds == pytest.approx(c.intra.latency + 8 * MiB / c.intra.bandwidth)
    assert far.seconds == pytest.approx(c.inter.latency + 8 * MiB / c.inter.bandwidth)
    assert collective_time(c, Collective.ALL_REDUCE, MiB, [3]).seconds == 0.0


def test_cpu_all_reduce_matches_platform_measurement() -> None:
    # PLATFORM.md: a 4 MiB all-reduce takes about 4 ms on gloo at 2 ranks.
    c = parse_cluster("2xCPU-2core")
    t = collective_time(c, Collective.ALL_REDUCE, 4 * MiB, (0, 1)).seconds
    assert t == pytest.approx(4e-3, rel=0.1)


def test_ranks_sharing_a_nodes_cores_each_run_at_their_share() -> None:
    """4 gloo ranks on a 2-core node run at half a core each: compute, memory and the
    loopback link between them (``torchweave demo`` runs 4 ranks on this 2-core machine)."""
    own, shared = parse_cluster("2xCPU-2core"), parse_cluster("4xCPU-2core@4")
    eff = own.device.shared_efficiency  # measured by calibrate: contention beyond the share
    assert 0 < eff <= 1
    assert own.device.peak.fp32 * eff == pytest.approx(shared.device.peak.fp32 * 2)
    assert own.device.memory_bandwidth * eff == pytest.approx(shared.device.memory_bandwidth * 2)
    assert own.intra.bandwidth * eff == pytest.approx(shared.intra.bandwidth * 2)
    # Ranks sharing cores arrive at collectives out of step: each waits; ranks in step do not.
    assert own.device.collective_wait == 0 and shared.device.collective_wait > 0
    one = collective_time(own, Collective.ALL_REDUCE, 4, (0, 1)).seconds
    assert collective_time(shared, Collective.ALL_REDUCE, 4, (0, 1)).seconds > one + 1e-3
    assert parse_cluster("4xCPU-2core").device.peak.fp32 == own.device.peak.fp32  # 2 nodes of 2
    assert "4 ranks share the node's 2 cores" in shared.device.description
    again = cluster_from_dict(cluster_to_dict(shared))  # a dumped cluster is not shared twice
    assert again.device.peak.fp32 == shared.device.peak.fp32
    graph = captured("gpt-tiny")
    plan = resolve("dp", graph, 4)
    four_cores = cluster_of(dataclasses.replace(lookup("CPU-2core"), cores=4), 4, 4)
    slow, fast = (simulate(graph, plan, c).step_time for c in (shared, four_cores))
    assert slow > 1.5 * fast
    assert parse_cluster("8xA100-80GB-SXM").device == lookup("A100-80GB-SXM")  # GPUs: no sharing



def test_a_pipeline_on_shared_cores_gives_its_bubble_to_the_busy_ranks() -> None:
    """A pipeline on one node whose 4 ranks share 2 cores: a rank waiting in the bubble
    leaves its cores to the ranks with work, so each moment of the schedule lasts
    ``max(share, fraction of ranks busy)`` of itself, not the shared step with its bubble
    (measured against real steps in docs/simulator.md). On two nodes the bubble stays:
    a node may hold one pipeline rank's group, idle together. Without sharing, nothing
    changes."""
    import torchweave
    from torchweave.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=4096, block_size=128, n_layer=4, n_head=4, d_model=256)
    idx = torch.zeros(8, 128, dtype=torch.long)  # bench/parallel.py's GPT: compute-bound
    graph = torchweave.capture(GPT(cfg), (idx, idx))
    plan = resolve("gpipe:pp=4,micro=4", graph, 4)
    one_node = parse_cluster("4xCPU-2core@4")
    res = simulate(graph, plan, one_node, timeline=True)
    assert one_node.share == pytest.approx(0.5 * one_node.device.shared_efficiency)
    # the rule again, by hand from the timeline's compute events (every device's)
    spans = [(e.start, e.end, e.rank) for e in res.timeline if e.stream == "compute"]
    moments = sorted({t for a, b, _ in spans for t in (a, b)})
    want = sum((b - a) * max(one_node.share, len({r for s, e, r in spans if s <= a and b <= e}) / 4)
               for a, b in zip(moments, moments[1:]))
    held = simulate(graph, plan, dataclasses.replace(one_node, share=1.0), timeline=False)
    after = held.step_time - moments[-1]  # the gradient sums and AdamW after the schedule
    assert res.step_time == pytest.approx(want + after)
    assert held.step_time >= max(held.compute_time)
    assert sum(res.compute_time) / 4 <= res.step_time  # no faster than the node's cores
    assert res.pipeline_bubble > 0.4 and res.step_time < 0.65 * held.step_time
    assert any("leave their share" in n for n in res.notes)
    nodes = parse_cluster("8xCPU-2core@4")  # 2 nodes: the shared step, bubble and all
    res8 = simulate(graph, resolve("gpipe:pp=4,dp=2,micro=4", graph, 8), nodes, timeline=False)
    assert res8.step_time >= max(res8.compute_time) and not any("leave their share" in n
                                                                  for n in res8.notes)
    own = parse_cluster("4xCPU-2core@2")  # 2 ranks a node on 2 cores: each has its own
    assert own.share == 1.0
    alone = simulate(graph, plan, own, timeline=False)
    assert alone.step_time >= max(alone.compute_time)
    assert not any("leave their share" in n for n in alone.notes)
    assert cluster_from_dict(cluster_to_dict(one_node)).share == 1.0  # rates dumped as shared

def test_collective_errors() -> None:
    c = parse_cluster("8xA100-80GB-SXM")
    with pytest.raises(SimError, match=r"ranks \[8\]"):
        collective_time(c, Collective.ALL_REDUCE, MiB, [0, 8])
    with pytest.raises(SimError, match="p2p takes"):
        collective_time(c, Collective.P2P, MiB, [0, 1, 2])
    with pytest.raises(SimError, match="applies here: ring"):
        collective_time(c, Collective.ALL_GATHER, MiB, range(8), algorithm=Algorithm.TREE)
    with pytest.raises(SimError, match="must be > 0"):
        Link(bandwidth=0, latency=1e-6)


# --- memory -----------------------------------------------------------------

def test_zero_memory_matches_paper() -> None:
    # ZeRO paper, Figure 1: 7.5B parameters, mixed precision (K=12), Nd=64.
    expect = {0: 120e9, 1: 31.4e9, 2: 16.6e9, 3: 1.9e9}
    for stage, total in expect.items():
        m = model_state_memory(7_500_000_000, dp=64, stage=stage, precision="bf16-mixed")
        assert m.total == pytest.approx(total, rel=0.02), m


def test_zero3_is_total_over_n() -> None:
    n, dp = 1_000_003, 8
    full = model_state_memory(n, precision="fp32").total
    assert full == 16 * n
    sharded = model_state_memory(n, dp=dp, stage=3, precision="fp32")
    assert sharded.total == pytest.approx(full / dp, rel=1e-5)
    assert model_state_memory(n, dp=dp, stage=2).params == 4 * n
    assert sharded.contributors()[0] == ("optimizer state", sharded.optimizer)


def test_zero_memory_errors() -> None:
    with pytest.raises(SimError) as err:
        model_state_memory(-1, dp=0, stage=4, precision="fp64")  # type: ignore[arg-type]
    assert len(err.value.problems) == 4


# --- compute ----------------------------------------------------------------

def _ops(target: str):
    graph = captured("gpt-tiny")
    return graph, [info(graph, n) for n in graph.nodes if n.target == target]


def test_roofline_on_captured_ops() -> None:
    graph, linears = _ops("aten.linear.default")
    op = max(linears, key=lambda o: o.flops)
    assert dtype_of(graph, op.node) == torch.float32
    a100 = CATALOG["A100-80GB-SXM"]
    t = op_time(op, a100)
    compute = op.flops / (a100.peak.fp32 * a100.matmul_efficiency)  # 0.869, published
    memory = op.bytes / (a100.memory_bandwidth * a100.bandwidth_efficiency)
    assert t.fwd == pytest.approx(max(compute, memory)) and t.precision == "fp32"
    assert t.bound == ("compute" if compute >= memory else "memory")
    assert t.bwd > t.fwd  # twice the FLOPs and twice the bytes
    # TF32 and bf16 run a matmul on tensor cores: never slower.
    assert op_time(op, a100, model=ComputeModel(tf32=True)).fwd <= t.fwd
    assert op_time(op, a100, dtype=torch.bfloat16).precision == "bf16"


def test_roofline_elementwise_views_and_devices() -> None:
    _, gelus = _ops("aten.gelu.default")
    _, views = _ops("aten.view.default")
    h100, a100 = CATALOG["H100-80GB-SXM"], CATALOG["A100-40GB-SXM"]
    g = op_time(gelus[0], h100)
    assert g.bound == "memory" and g.precision == "fp32"
    assert g.fwd == pytest.approx(gelus[0].bytes / (h100.memory_bandwidth * h100.bandwidth_efficiency))
    assert op_time(gelus[0], a100).fwd > g.fwd  # less bandwidth
    assert op_time(views[0], h100).bound == "free" and op_time(views[0], h100).fwd == 0.0
    # A measured device gets efficiency 1: its rates are already what real work reaches.
    assert ComputeModel.for_device(CATALOG["CPU-2core"]).matmul == 1.0


def test_roofline_errors() -> None:
    _, linears = _ops("aten.linear.default")
    with pytest.raises(SimError, match="no bf16 rate"):
        op_time(linears[0], CATALOG["V100-32GB-SXM2"], dtype=torch.bfloat16)
    with pytest.raises(SimError, match="efficiency is in"):
        ComputeModel(matmul=1.5)


def test_lookup_and_cluster_of() -> None:
    assert lookup("rtx4090") is CATALOG["RTX4090"]
    assert cluster_of(CATALOG["CPU-2core"], 2).nodes == 1


def test_plan_auto_on_a_cpu_counts_this_machines_cores(monkeypatch) -> None:
    """``plan: auto`` on a CPU: 4 ranks on 2 cores are predicted about twice as slow as
    4 ranks on 4 cores (the demo's 28.3 ms prediction against 116.8 ms measured)."""
    import os

    from torchweave.train.auto import choose_plan

    graph = captured("gpt-tiny")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine is a CPU
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    shared = choose_plan(graph, 4)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    own = choose_plan(graph, 4)
    assert shared.predicted_s[shared.plan] > 1.5 * own.predicted_s[own.plan]


@pytest.mark.parametrize("cores", [0, -2, "x", 2.5, True, "__import__('os').system('true')"])
def test_a_bad_core_count_in_a_cluster_yaml_is_refused(cores) -> None:
    with pytest.raises(SimError, match="cores"):
        cluster_from_dict({"device": {"base": "CPU-2core", "cores": cores}, "nodes": 1,
                           "devices_per_node": 4})
