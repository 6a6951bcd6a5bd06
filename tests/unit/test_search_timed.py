"""Pipelined points priced by their own schedule on per-stage costs from the real cut
(``search/timed.py``): the same timing as the simulator's schedule engine, and an uneven
encoder-decoder cut priced within a few percent of the simulator where the arithmetic
is far off."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import torchweave
from torchweave.models.t5 import T5, T5Config
from torchweave.plan.schedules.builtin import builtin
from torchweave.policies.spec import PlanSpec
from torchweave.search.estimate import estimate
from torchweave.search.proxies import proxy
from torchweave.search.space import Point
from torchweave.search.makespan import compile_schedule, exposed_sums, makespans
from torchweave.search.timed import Timing
from torchweave.sim import parse_cluster
from torchweave.sim.fast.fold import find_blocks, with_twin
from torchweave.sim.simulate import simulate
from torchweave.sim.step.pipelined import RankCosts, Sums, finish_times
from torchweave.sim.step.schedule import StageCost, simulate_schedule

CASES = [("gpipe", 3, 1, 5), ("1f1b", 4, 1, 6), ("interleaved", 2, 3, 4),
         ("interleaved", 4, 2, 8), ("zb", 4, 1, 7)]


@pytest.mark.parametrize("kind,pp,virtual,micro", CASES)
def test_the_vectorised_schedule_times_as_the_simulators_engine(kind, pp, virtual, micro):
    rng = np.random.default_rng(pp * 10 + virtual)
    stages, k = pp * virtual, 3
    fwd = rng.uniform(0.5, 2.0, (stages, k))
    bwd = fwd * rng.uniform(1.5, 2.5, (stages, k))
    nbytes = rng.integers(0, 1 << 20, stages)
    lat, per_byte = 1e-3, 1e-6
    hop = np.stack([lat + nbytes * per_byte * (j + 1) for j in range(k)], axis=1)
    sched = builtin(kind, pp, virtual, micro)
    run = makespans(compile_schedule(sched), fwd, bwd, hop)
    sums = rng.uniform(0.0, 3.0, (stages, k))  # each stage's gradient sum, seconds
    tied = np.zeros((stages, k))  # a tied weight's copies, summed after the schedule even
    tied[stages - pp:] = rng.uniform(0.0, 1.0, (pp, k))  # where read on a rank's last stage,
    # whose backward ends before the rank's schedule does (interleaved: its first backward)
    exposed = exposed_sums(run, sums, tied)
    for j in range(k):
        costs = [StageCost(fwd=float(fwd[s, j]), bwd=float(bwd[s, j]), boundary=int(nbytes[s]))
                 for s in range(stages)]
        ref = simulate_schedule(sched, costs,
                                transfer=lambda n, j=j: lat + n * per_byte * (j + 1))
        assert run.step[j] == pytest.approx(ref.step_time, rel=1e-9)
        assert run.busy[j] == pytest.approx(max(ref.busy.values()), rel=1e-9)
        # the sums as the simulator's finish_times overlaps them (rank q holds stages
        # q, q + pp, ...; no ZeRO)
        plan = SimpleNamespace(pipeline=SimpleNamespace(groups=[[q] for q in range(pp)]), zero=0)
        ranks = {q: RankCosts(syncs={(frozenset({s}), (q,)): Sums(1, 0.0, float(sums[s, j]), (q,))
                                     for s in range(q, stages, pp)}) for q in range(pp)}
        for q in range(pp):  # the copies' group spans two pipeline ranks
            grp, last = (q, (q + 1) % pp), stages - pp + q
            ranks[q].syncs[(frozenset({last}), grp)] = Sums(1, 0.0, float(tied[last, j]), grp)
        ends = finish_times(plan, ref, ranks)
        assert exposed[j] == pytest.approx(max(ends.values()) - ref.step_time, rel=1e-9, abs=1e-12)


@pytest.fixture(scope="module")
def t5():
    """A T5 whose encoder runs over 4x the decoder's tokens, with a large vocabulary: its
    FLOP-balanced stages hold different numbers of whole layers, the head the last one."""
    cfg = T5Config(vocab_size=65536, block_size=1024, d_model=1024, d_kv=64, n_head=16,
                   d_ff=2816, n_enc_layer=12, n_dec_layer=12)
    with torch.device("meta"):
        model = T5(cfg)
        src = torch.zeros(32, 1024, dtype=torch.long)
        tgt = torch.zeros(32, 256, dtype=torch.long)
    return torchweave.capture(model, (src, tgt, tgt))


def test_uneven_stages_are_priced_by_their_schedule(t5):
    cluster = parse_cluster("16xV100-32GB-SXM2@8")
    dtype = torch.float16
    base = PlanSpec.parse("dp").build(t5, 1)
    blocks = with_twin(t5, base, find_blocks(t5, base, least=4, nested=False))
    assert blocks.twin == "decoder" and len(blocks) == 12
    px = proxy(t5, blocks, cluster, 2, True, "none", dtype=dtype, precision="bf16-mixed")
    timing = Timing(t5, blocks, cluster, dtype, 32)
    arithmetic, timed = [], []
    for pp, virtual, micro in ((4, 1, 8), (4, 3, 8), (2, 6, 8)):
        pt = Point(tp=2, pp=pp, dp=16 // (2 * pp), micro=micro, virtual=virtual,
                   schedule="interleaved" if virtual > 1 else "1f1b", recompute="none",
                   zero=0, sp=True)
        sim = simulate(t5, PlanSpec.parse(pt.spec).build(t5, 16), cluster, dtype=dtype).step_time
        old = estimate(pt, px, cluster, len(blocks), precision="bf16-mixed")
        new = estimate(pt, px, cluster, len(blocks), precision="bf16-mixed",
                       schedule_s=timing.price([(pt, px)], len(blocks))[pt])
        arithmetic.append(abs(old.step_s / sim - 1))
        timed.append(abs(new.step_s / sim - 1))
        assert new.p2p_s == 0.0 and new.bubble_s > 0  # transfers are among the waits
    assert max(timed) <= 0.05, (arithmetic, timed)
    # the case the schedule is for: the arithmetic (every stage charged the whole rest,
    # stages of equal cost) is far off here
    assert max(arithmetic) > 0.08, arithmetic


def test_plans_that_are_not_plain_pipelines_are_refused():
    from torchweave.plan.interlaced import interlaced_1f1b

    with pytest.raises(ValueError, match="shared stage"):
        compile_schedule(interlaced_1f1b(4, 8))


def test_a_boundary_carries_what_the_next_stages_read(t5):
    """Sizes as lowering moves them: the residual crosses as its sequence shard, T5's
    encoder output (sequence-split where it is made, read whole by cross-attention's
    column-parallel linears) whole; a value crosses once into each other pipeline rank
    that reads it (an interleaved rank keeps its copy for its later stages)."""
    from torchweave.search.proxies import read_shares

    shares = read_shares(t5, PlanSpec.parse("sp:tp=2,dp=1").build(t5, 2))
    enc_out = [n for n in t5.nodes if n.module == "enc_norm"][-1].outputs[0]
    residual = [n for n in t5.nodes if n.module == "encoder.3"][-1].outputs[0]  # the block's output
    assert shares[enc_out] == 1.0 and shares[residual] == 0.5
    base = PlanSpec.parse("dp").build(t5, 1)
    blocks = with_twin(t5, base, find_blocks(t5, base, least=4, nested=False))
    sh = Timing(t5, blocks, parse_cluster("16xV100-32GB-SXM2@8"), torch.float16, 32).shares(12)
    bias = [c for c in sh.crossing if c[4] == "fixed" and len(c[2]) > 2]
    assert bias  # the relative-position bias: made on stage 0, read by the encoder's stages
    name, made, readers, nbytes, _ = bias[0]
    one = {name: 1.0}
    into = sh.received(2, "fixed", one, 0.0)  # pp = 2: stages 1, 3, 5 ... on rank 1
    assert made == 0 and into[readers[0] - 1] == nbytes and into.sum() == nbytes
    into = sh.received(12, "fixed", one, 0.0)  # one stage a rank: into each reader
    assert into.sum() == nbytes * len(readers)


def test_cuts_inside_blocks_are_priced_within_5_percent(t5):
    """The search's cut by seconds (``search/cuts.py``) starts stages inside layers: what
    crosses there (a norm's output that column-parallel linears read whole, the residual
    as its shard) is sized as lowering sends it, and the point's estimate stays within 5%
    of the simulator."""
    from torchweave.search.constraints_file import preset
    from torchweave.search.cuts import seconds_points
    from torchweave.search.proxies import read_shares

    cluster = parse_cluster("16xV100-32GB-SXM2@8")
    dtype = torch.float16
    base = PlanSpec.parse("dp").build(t5, 1)
    blocks = with_twin(t5, base, find_blocks(t5, base, least=4, nested=False))
    shares = read_shares(t5, PlanSpec.parse("sp:tp=2,dp=1").build(t5, 2))
    normed = [n for n in t5.nodes if n.module == "encoder.3.ff_norm"][-1].outputs[0]
    residual = [n for n in t5.nodes if n.module == "encoder.3"][0].outputs[0]  # after attention
    assert shares[normed] == 1.0 and shares[residual] == 0.5
    px = proxy(t5, blocks, cluster, 2, True, "none", dtype=dtype, precision="bf16-mixed")
    timing = Timing(t5, blocks, cluster, dtype, 32)
    pts = [Point(tp=2, pp=4, dp=2, micro=8, virtual=v, schedule=s, recompute="none", zero=0, sp=True)
           for s, v in (("1f1b", 1), ("interleaved", 3))]
    cut = seconds_points(t5, blocks, preset("free"), pts, timing.op_seconds)
    assert len(cut) == 2 and any(m.count(".") >= 2 for p in cut for m in p.cuts)  # inside a layer
    for pt in cut:
        sim = simulate(t5, PlanSpec.parse(pt.spec).build(t5, 16), cluster, dtype=dtype).step_time
        est = estimate(pt, px, cluster, len(blocks), precision="bf16-mixed",
                       schedule_s=timing.price([(pt, px)], len(blocks))[pt])
        assert abs(est.step_s / sim - 1) <= 0.05, (pt.spec, est.step_s, sim)



def test_a_micro_batch_pays_each_collectives_latency_whole():
    """A stage's program runs once a micro-batch, so each of its tensor-parallel collectives
    runs once a micro-batch over a share of the bytes and pays its latency each time (the
    simulator: ``StepContext.times``). The estimate scales a proxy's seconds with the
    micro-batch but not its collectives' latency (``Proxy.block_at``): on CPU ranks sharing
    cores, where every collective waits milliseconds for its last rank, a small GPT's
    pipelines stay within 5% of the simulator, and are far off when the latency is scaled
    too."""
    from dataclasses import replace

    g, cluster, blocks, px, timing = _cpu_gpt(512, 64, 8, 64, "8xCPU-2core@8", tp=2)
    assert 0 < px.block_lat < px.block_comm
    scaled = replace(px, block_lat=0.0, rest_lat=0.0)  # the latency shrinking with the batch
    for pp, micro in ((2, 4), (4, 8)):
        pt = Point(tp=2, pp=pp, dp=8 // (2 * pp), micro=micro, virtual=1, schedule="1f1b",
                   recompute="none", zero=0, sp=False)
        sim = simulate(g, PlanSpec.parse(pt.spec).build(g, 8), cluster).step_time
        est, old = (estimate(pt, p, cluster, len(blocks), precision="fp32",
                             schedule_s=timing.price([(pt, p)], len(blocks))[pt]).step_s
                    for p in (px, scaled))
        assert abs(est / sim - 1) <= 0.05, (pt.spec, est, sim)
        assert old / sim - 1 < -0.10, (pt.spec, old, sim)


def test_pipelines_on_shared_cores_are_priced_as_the_simulator_prices_them():
    """Ranks sharing one node's cores: a pipeline rank waiting in the bubble leaves its
    cores to the others (``sim/step/run.shared_cores_step``, on the schedule's timeline).
    The estimate applies the same rule to the schedule it runs (``timed.py``), so on a
    compute-bound GPT at 4 ranks on 2 cores its pipelines stay within 5% of the simulator,
    where the bubble-charging estimate is far over."""
    from dataclasses import replace

    g, cluster, blocks, px, timing = _cpu_gpt(4096, 128, 4, 256, "4xCPU-2core@4", tp=1)
    for pp, dp, schedule in ((4, 1, "1f1b"), (4, 1, "gpipe"), (2, 2, "1f1b")):
        pt = Point(tp=1, pp=pp, dp=dp, micro=4, virtual=1, schedule=schedule,
                   recompute="none", zero=0, sp=False)
        res = simulate(g, PlanSpec.parse(pt.spec).build(g, 4), cluster, timeline=False)
        assert any("leave their share" in n for n in res.notes)
        priced = timing.price([(pt, px)], len(blocks))[pt]
        est = estimate(pt, px, cluster, len(blocks), precision="fp32", schedule_s=priced)
        assert abs(est.step_s / res.step_time - 1) <= 0.05, (pt.spec, est.step_s, res.step_time)
        assert est.bubble_s < 0.5 * est.compute_s  # what the bubble still costs: little
        assert priced.shared_s is not None and priced.shared_s < priced.step_s
        unshared = estimate(pt, px, replace(cluster, share=1.0), len(blocks), precision="fp32",
                            schedule_s=replace(priced, shared_s=None))  # each held to its share
        assert unshared.step_s / res.step_time > 1.25, (pt.spec, unshared.step_s)


def _cpu_gpt(vocab: int, seq: int, layers: int, d: int, spec: str, *, tp: int):
    """A GPT of batch 8 on the CPU cluster ``spec``: graph, cluster, blocks, the proxy of
    Megatron's split at ``tp`` and the schedule timing."""
    from torchweave.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=4, d_model=d)
    g = torchweave.capture(GPT(cfg), (torch.zeros(8, seq, dtype=torch.long),) * 2)
    cluster = parse_cluster(spec)
    base = PlanSpec.parse("dp").build(g, 1)
    blocks = with_twin(g, base, find_blocks(g, base, least=4, nested=False))
    px = proxy(g, blocks, cluster, tp, False, "none", dtype=None, precision="fp32")
    return g, cluster, blocks, px, Timing(g, blocks, cluster, None, 8)
