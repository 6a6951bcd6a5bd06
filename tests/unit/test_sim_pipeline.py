"""Pipeline schedules simulated with per-stage costs: bubble, micro-batches in flight, memory."""

from __future__ import annotations

import math

import pytest

from torchweave.errors import SimError
from torchweave.plan.schedules import (
    bubble_fraction, gpipe, interleaved_1f1b, one_f_one_b, zero_bubble_h1,
)
from torchweave.sim.step.schedule import StageCost, simulate_schedule

MiB = 2**20


def _costs(n: int, **kw) -> list[StageCost]:
    return [StageCost(fwd=1.0, bwd=2.0, activations=10 * MiB, inputs=MiB, boundary=MiB, **kw)
            for _ in range(n)]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_gpipe_and_1f1b_bubble_is_the_textbook_one(p: int, m: int) -> None:
    """(p-1)/(m+p-1) of the step is idle (Huang et al., GPipe; Narayanan et al., SC'21)."""
    for schedule in (gpipe(p, m), one_f_one_b(p, m)):
        step = simulate_schedule(schedule, _costs(p))
        assert step.step_time == pytest.approx(3 * (m + p - 1))
        assert step.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert step.bubble_fraction == pytest.approx(bubble_fraction(schedule))


def test_1f1b_holds_fewer_micro_batches_than_gpipe() -> None:
    p, m = 4, 8
    g = simulate_schedule(gpipe(p, m), _costs(p))
    f = simulate_schedule(one_f_one_b(p, m), _costs(p))
    assert g.in_flight == {r: m for r in range(p)}
    assert f.in_flight == {r: p - r for r in range(p)}
    assert f.activation_peak[0] == 4 * 10 * MiB < g.activation_peak[0] == 8 * 10 * MiB


def test_zero_bubble_and_interleaved_shrink_the_bubble() -> None:
    p, m = 4, 8
    base = simulate_schedule(one_f_one_b(p, m), _costs(p)).bubble_fraction
    zb = simulate_schedule(zero_bubble_h1(p, m), _costs(p))
    assert zb.bubble_fraction < base
    # Interleaved: 2 virtual stages per rank, each half the work.
    half = [StageCost(fwd=0.5, bwd=1.0, activations=5 * MiB) for _ in range(2 * p)]
    inter = simulate_schedule(interleaved_1f1b(p, 2, m), half)
    assert inter.bubble_fraction < base


def test_recompute_trades_time_for_memory() -> None:
    p, m = 4, 8
    keep = simulate_schedule(one_f_one_b(p, m), _costs(p))
    again = simulate_schedule(one_f_one_b(p, m), _costs(p, recompute=True))
    assert again.step_time > keep.step_time
    assert again.activation_peak[0] == 4 * MiB < keep.activation_peak[0]


def test_transfers_between_ranks_add_time() -> None:
    p, m = 4, 8
    free = simulate_schedule(one_f_one_b(p, m), _costs(p))
    slow = simulate_schedule(one_f_one_b(p, m), _costs(p), transfer=lambda n: n / (10 * MiB))
    assert slow.step_time > free.step_time


def test_missing_stage_costs_name_the_rule() -> None:
    with pytest.raises(SimError, match="one StageCost per stage"):
        simulate_schedule(one_f_one_b(4, 8), _costs(2))


# ----------------------------------------------------------------- pipelined plans


def _gpt_meta(layers: int = 8, batch: int = 16):
    import torch

    import torchweave
    from torchweave.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=4096, block_size=256, n_layer=layers, n_head=8, d_model=1024)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.empty(batch, 256, dtype=torch.long)
    return torchweave.capture(model, (idx, idx), name="gpt-meta")


def test_pipelined_plans_report_bubble_in_flight_and_memory() -> None:
    from torchweave.policies.pipeline_policy import pipeline
    from torchweave.sim import parse_cluster, simulate

    g = _gpt_meta()
    cluster = parse_cluster("4xA100-80GB-SXM")
    runs = {s: simulate(g, pipeline(g, 4, schedule=s, micro=8), cluster)
            for s in ("gpipe", "1f1b", "zb")}
    for name, r in runs.items():
        assert r.step_time > 0 and r.pipeline_bubble is not None
        assert name in r.notes[0] and "in flight" in r.notes[0]
    gp, fb, zb = runs["gpipe"], runs["1f1b"], runs["zb"]
    # Compute-bound stages: the bubble is near the textbook (p-1)/(m+p-1) = 3/11.
    assert 0.2 < fb.bubble < 0.45
    assert zb.bubble < fb.bubble
    # 1F1B holds at most p - r micro-batches; GPipe all of them.
    assert "[8, 8, 8, 8]" in gp.notes[0] and "[4, 3, 2, 1]" in fb.notes[0]
    assert fb.memory[0].activations < gp.memory[0].activations
    # More micro-batches: a smaller bubble.
    more = simulate(g, pipeline(g, 4, schedule="1f1b", micro=16), cluster)
    assert more.bubble < fb.bubble


def test_a_pipelines_temporary_buffers_are_one_micro_batchs() -> None:
    """Forward's temporaries (twice the largest op output) are one micro-batch's in a
    pipeline: the 1T GPT of bench/sim_published.py was given 100 GiB of them, twice the
    whole batch's largest op output."""
    from torchweave.policies.pipeline_policy import pipeline
    from torchweave.sim import parse_cluster, simulate

    g = _gpt_meta(batch=32)
    cluster = parse_cluster("4xA100-80GB-SXM")
    temps = {m: max(x.temporaries for x in simulate(g, pipeline(g, 4, schedule="1f1b", micro=m),
                                                     cluster, timeline=False).memory)
             for m in (4, 16)}
    logits = 32 * 256 * 4096 * 4  # the whole batch's largest output, fp32 (one rank: the head)
    assert temps[4] == 2 * logits // 4 and temps[16] == 2 * logits // 16


def test_recompute_groups_trade_time_for_activation_memory() -> None:
    from torchweave.policies import resolve
    from torchweave.sim import parse_cluster, simulate

    g = _gpt_meta(layers=4)
    cluster = parse_cluster("2xA100-80GB-SXM")
    plain = resolve("dp", g, 2)
    again = resolve("dp", g, 2)
    for b in range(4):
        again.recompute.append(tuple(n.name for n in g.nodes if n.module.startswith(f"blocks.{b}.")))
    a, b = simulate(g, plain, cluster), simulate(g, again, cluster)
    assert b.memory[0].activations < 0.5 * a.memory[0].activations
    assert max(b.compute_time) > max(a.compute_time)


def test_pipelined_timeline_has_each_action_on_each_device() -> None:
    from tests.conftest import captured
    from torchweave.policies import resolve
    from torchweave.sim import parse_cluster, simulate, to_chrome_trace

    g = captured("gpt-tiny")
    r = simulate(g, resolve("1f1b", g, 2), parse_cluster("2xA100-80GB-SXM"))
    names = {(e.rank, e.name) for e in r.timeline}
    assert (0, "0F0") in names and (1, "1B3") in names
    assert {e["pid"] for e in to_chrome_trace(r)["traceEvents"] if e["ph"] == "X"} == {0, 1}


def test_shared_stages_run_on_every_rank_at_once() -> None:
    """Interlaced pipelines: the shared embedding and head stages are barriers."""
    from tests.conftest import captured
    from torchweave.policies import resolve
    from torchweave.sim import parse_cluster, simulate

    g = captured("gpt-tiny")
    plan = resolve("interlaced", g, 2)
    shared = set(plan.pipeline.shared)
    assert shared
    r = simulate(g, plan, parse_cluster("2xA100-80GB-SXM"))
    starts: dict[str, set[float]] = {}
    for e in r.timeline:
        if int(e.name[0]) in shared:
            starts.setdefault(e.name, set()).add(round(e.start, 12))
    assert starts and all(len(s) == 1 for s in starts.values())
    assert r.step_time > 0 and "interlaced" in r.notes[0]


def test_gradient_sums_overlap_the_schedule_where_the_device_can() -> None:
    """pp × dp, as the runtime runs it: a stage's sums start after its last backward.

    Interleaved puts stages 0 and 2 on the first pipeline rank; stage 2's sums
    run while stage 0 still computes. A device whose communication takes its
    compute cores (``comm_overlaps_compute=False``) runs them after the last
    action, and so does ZeRO-1 (it shards after the last action).
    """
    import dataclasses

    from torchweave.policies.pipeline_policy import pipeline
    from torchweave.sim import parse_cluster, simulate

    g = _gpt_meta(layers=4, batch=8)
    fast = parse_cluster("4xA100-80GB-PCIe@1")  # replicas one node apart: slow sums
    serial = dataclasses.replace(fast, device=dataclasses.replace(fast.device, comm_overlaps_compute=False))
    plan = pipeline(g, 4, schedule="interleaved", dp=2, micro=4)
    over, after = simulate(g, plan, fast), simulate(g, plan, serial)
    assert over.step_time < after.step_time
    assert over.compute_time == after.compute_time and over.comm_time == after.comm_time  # same work, earlier
    # With ZeRO-1 both devices sum after the last action: no difference.
    z = pipeline(g, 4, schedule="interleaved", dp=2, micro=4, zero=1)
    assert simulate(g, z, fast).step_time == pytest.approx(simulate(g, z, serial).step_time)


@pytest.mark.parametrize("kind,ranks,virtual,micro", [
    ("gpipe", 4, 1, 6), ("1f1b", 4, 1, 8), ("zb", 4, 1, 8), ("interleaved", 4, 2, 8),
    ("interleaved", 2, 3, 4)])
def test_the_simulator_orders_actions_by_the_schedules_own_rules(kind, ranks, virtual, micro) -> None:
    """With no transfer time, every action starts and ends when ``plan.schedules``'
    ``timeline`` says: both read one dependency rule (``check.dependencies``)."""
    from torchweave.plan.schedules import builtin, timeline

    schedule = builtin(kind, ranks, virtual, micro)
    step = simulate_schedule(schedule, [StageCost(fwd=1.0, bwd=2.0)] * (ranks * virtual))
    ours = {(r, str(a)): (t0, t1) for r, t0, t1, a in step.events}
    theirs = {(r, str(a)): (t0, t1) for r, acts in timeline(schedule, cost_f=1.0, cost_b=2.0).items()
              for t0, t1, a in acts}
    assert ours.keys() == theirs.keys()
    for k, (t0, t1) in theirs.items():
        assert ours[k] == pytest.approx((t0, t1)), k


def test_a_value_without_the_batch_crosses_whole_with_each_micro_batch(monkeypatch) -> None:
    """T5's relative-position bias is made on stage 0 from parameters alone and read on
    later stages. The runtime runs a stage's program once a micro-batch, so the bias crosses
    whole each time, while a batch-split activation crosses a ``1/micro`` share. A stage's
    bytes in per micro-batch are ``A / micro + F``: from two micro counts, ``F`` is the
    bias's whole bytes (it was 0 when every task was divided by the micro count)."""
    import torchweave.sim.step.pipelined as pipelined
    from tests.conftest import captured
    from torchweave.policies.spec import PlanSpec
    from torchweave.sim import parse_cluster, simulate

    g = captured("t5-tiny")
    seen = {}
    real = pipelined.stage_costs

    def spy(plan, costs, recycled=0):
        seen[plan.pipeline.micro_batches] = out = real(plan, costs, recycled)
        return out

    monkeypatch.setattr(pipelined, "stage_costs", spy)
    plans = {m: PlanSpec.parse(f"1f1b:micro={m}").build(g, 4) for m in (2, 4)}
    for plan in plans.values():
        simulate(g, plan, parse_cluster("4xA100-80GB-SXM"), timeline=False)
    stage_of = plans[2].pipeline.stage_of
    batched = g.batched_values()
    made = {o: stage_of[n.name] for n in g.nodes for o in n.outputs if o}
    crossed = 0
    for s in range(1, 4):  # one stage a rank: each stage that reads a value receives it
        fixed = {r.name for n in g.nodes for r in n.input_refs()
                 if made.get(r.name, s) < s == stage_of[n.name] and r.name not in batched}
        whole = sum(g.values[v].meta.nbytes for v in fixed)
        assert 2 * seen[4][s].inputs - seen[2][s].inputs == pytest.approx(whole, abs=2), s
        crossed += whole
    assert crossed  # the case is there: the decoder's bias crosses into stages 1 and 2


def test_zero_keeps_a_tied_weights_copies_whole_in_the_memory_model() -> None:
    """The runtime's ZeRO owns the pieces its mesh group sums (runtime/zero.py); a tied
    weight's copies are summed across stage groups, so they keep whole gradients and
    optimizer state. The memory model counts them so: each rank's state is its other
    parameters' sharded plus the copy whole."""
    from torchweave.lower.lower import lower
    from torchweave.policies.spec import PlanSpec
    from torchweave.sim import parse_cluster, simulate
    from torchweave.sim.hardware.memory import model_state_memory
    from torchweave.sim.step.run import zero_group

    g = _gpt_meta(layers=4, batch=8)
    for zero in (1, 2):
        plan = PlanSpec.parse(f"1f1b:dp=2,zero={zero}").build(g, 4)
        progs = lower(g, plan, stages=False)
        res = simulate(g, plan, parse_cluster("4xA100-80GB-SXM@4"), fold=False)
        for prog, mem in zip(progs, res.memory):
            own = [math.prod(b - a for a, b in s.box) for s in prog.params if not s.is_buffer]
            copy = sum(math.prod(b - a for a, b in s.box) for s in prog.params if s.copied)
            assert copy == 4096 * 1024  # wte on both pipeline ranks
            dp = zero_group(plan, prog.rank)
            assert dp == 2
            sharded = model_state_memory(sum(own) - copy, dp=dp, stage=zero)
            whole = model_state_memory(copy)
            assert mem.optimizer == sharded.optimizer + whole.optimizer, (zero, prog.rank)
            assert mem.grads == math.ceil(model_state_memory(sum(own) - copy).grads / dp) + whole.grads


@pytest.mark.parametrize("split", ["", ",split=sequence"])
def test_a_stages_collectives_run_once_a_micro_batch(split: str) -> None:
    """A pipelined plan is lowered for the whole batch, but a stage's program runs once a
    micro-batch, so each tensor-parallel collective inside a stage runs ``micro`` times over
    a micro-batch's bytes and pays its latency each time: a rank's communication seconds are
    ``micro · L + B / bandwidth``, affine in the micro count with the slope ``L``, the
    latency of the rank's collectives. (They were one collective over the whole batch, the
    same seconds at every micro count.) Under sequence parallelism that includes the
    gathers run again in backward (``runtime/regather.py``)."""
    from tests.conftest import captured
    from torchweave.policies.spec import PlanSpec
    from torchweave.sim import parse_cluster, simulate

    g = captured("gpt-tiny")
    cluster = parse_cluster("4xA100-80GB-SXM")
    comm = {m: simulate(g, PlanSpec.parse(f"1f1b:tp=2,pp=2,micro={m}{split}").build(g, 4),
                        cluster, timeline=False).comm_time for m in (2, 4, 8)}
    for r in range(4):
        slope = (comm[4][r] - comm[2][r]) / 2
        assert slope > 0
        assert comm[8][r] - comm[4][r] == pytest.approx(4 * slope, rel=1e-6)
    if split:  # each gather run again in backward costs what its forward gather costs; its
        # latency counts where a stage pays it (those after a stage's first are hidden
        # behind compute: pipelined.hidden)
        from torchweave.lower.lower import lower
        from torchweave.sim.hardware.compute import ComputeModel
        from torchweave.sim.step.build import Builder

        plan = PlanSpec.parse(f"1f1b:tp=2,pp=2,micro=4{split}").build(g, 4)
        tasks, _ = Builder(g, plan, cluster, None, ComputeModel(), 25 << 20).tasks(lower(g, plan)[0])
        fwd = {t.name: t for t in tasks}
        again = [t for t in tasks if t.name.endswith(" again")]
        assert again
        from torchweave.sim.step.pipelined import hidden

        for t in again:
            gather = fwd[t.name.split("_all_gather")[0]]
            assert t.dur == pytest.approx(gather.dur)
            if hidden(t, True):
                assert t.latency == 0
            else:
                assert t.latency == pytest.approx(gather.latency) and t.latency > 3 * t.dur / 4
        assert any(not hidden(t, True) for t in again)  # a stage's first: four latencies
    # without tensor parallelism inside the stages only the transfers between stages move,
    # which the schedule costs a micro-batch at a time: none is repeated here
    flat = {m: simulate(g, PlanSpec.parse(f"1f1b:pp=4,micro={m}").build(g, 4), cluster,
                        timeline=False).comm_time for m in (2, 4)}
    assert flat[2] == flat[4]


def test_a_schedule_on_shared_cores_lasts_its_moments_at_the_ranks_busy() -> None:
    """``shared_cores_step`` by hand: two pipeline ranks (half the node each) at a share of
    0.3 of a core; rank 0 computes over [0, 2], rank 1 over [1, 3]. While one computes
    alone it runs at 0.3 / 0.5 = 0.6 of a core: each moment lasts max(0.3, busy) of
    itself, 0.5 + 1 + 0.5 = 2 of the 3 simulated seconds. Two sets of costs at once."""
    import numpy as np

    from torchweave.sim.step.run import shared_cores_step

    starts = np.array([[0.0, 0.0], [1.0, 3.0]])
    ends = np.array([[2.0, 2.0], [3.0, 4.0]])  # the second set: rank 1 over [3, 4], a gap
    got = shared_cores_step(starts, ends, np.array([[0.5], [0.5]]), 0.3)
    assert got[0] == pytest.approx(0.5 + 1.0 + 0.5)
    assert got[1] == pytest.approx(2 * 0.5 + 1 * 0.3 + 1 * 0.5)  # idle: as fast as the share
