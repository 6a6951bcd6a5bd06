"""Profiled op timings: cached by op, local shapes, dtype and device; used in place of the roofline."""

from __future__ import annotations

import pytest

from tests.conftest import captured
from torchweave.policies import resolve
from torchweave.sim import parse_cluster, simulate
from torchweave.sim.hardware.profile import OpProfiles, first_piece, op_key, profile_graph


def test_profile_times_each_distinct_piece_once_and_round_trips(tmp_path) -> None:
    g = captured("gpt-tiny")
    plan = resolve("dp", g, 2)
    prof = OpProfiles("cpu test")
    n = profile_graph(g, plan, prof, reps=1)
    keys = {op_key(g, node, first_piece(plan, node.name), None) for node in g.nodes}
    assert 0 < n <= len(keys) + 1  # distinct pieces, plus the optimizer step
    assert all(f >= 0 and b >= 0 for f, b in prof.table.values())
    # A second pass finds everything cached; a plan that cuts differently adds entries.
    assert profile_graph(g, plan, prof, reps=1) == 0
    assert profile_graph(g, resolve("tp", g, 2), prof, reps=1) > 0
    # Keys name the op and the piece's local shapes: dp halves the batch of 4.
    emb = next(node for node in g.nodes if node.target == "aten.embedding.default")
    assert "[2, 16]" in op_key(g, emb, first_piece(plan, emb.name), None)
    path = tmp_path / "p.json"
    prof.save(path)
    assert OpProfiles.load(path, device="cpu test").table == prof.table
    assert OpProfiles.load(path, device="another device").table == {}


def test_simulate_uses_profiled_times_in_place_of_the_roofline() -> None:
    g = captured("gpt-tiny")
    plan = resolve("dp", g, 2)
    cluster = parse_cluster("2xA100-80GB-SXM")
    prof = OpProfiles("test")
    profile_graph(g, plan, prof, reps=1)
    # Replace every timing by a known one: the simulated compute is their sum.
    prof.table = {k: (1e-3, 2e-3) for k in prof.table}
    res = simulate(g, plan, cluster, profiles=prof)
    grads = sum(1 for n in g.nodes if any(g.values[o].meta.dtype.is_floating_point for o in n.outputs))
    # Every node forward, every node with a floating output backward, the optimizer step; but
    # the count of targets, which each rank computes whole from the input (lower/loss.py), an
    # auxiliary step the simulator does not cost.
    assert g.values["cross_entropy_loss_count"].meta.dtype.is_floating_point
    assert max(res.compute_time) == pytest.approx(
        (len(g.nodes) - 1) * 1e-3 + (grads - 1) * 2e-3 + 1e-3, rel=1e-6)
    # scale multiplies every looked-up time.
    prof.scale = 2.0
    assert max(simulate(g, plan, cluster, profiles=prof).compute_time) > 1.9 * max(res.compute_time)
    assert max(simulate(g, plan, cluster).compute_time) < max(res.compute_time)


def test_sync_overhead_is_added_to_every_collective() -> None:
    from torchweave.sim.hardware.profile import profile_sync, sync_key

    prof = OpProfiles("test")
    extra = profile_sync(prof, ranks=2, all_reduce=lambda x: None, segment=1e-4, reps=3)
    assert extra >= 0 and prof.table[sync_key(2)] == (extra, 0.0)
    g = captured("gpt-tiny")
    plan = resolve("tp", g, 2)
    cluster = parse_cluster("2xA100-80GB-SXM")
    base = simulate(g, plan, cluster, profiles=OpProfiles("test"))
    prof = OpProfiles("test", {sync_key(2): (1e-3, 0.0)})
    slow = simulate(g, plan, cluster, profiles=prof)
    n = sum(1 for e in slow.timeline if e.rank == 0 and e.stream == "comm")
    assert n > 0
    assert slow.comm_time[0] == pytest.approx(base.comm_time[0] + n * 1e-3, rel=1e-6)
