"""Gradient accumulation in the simulator: k micro-steps, one gradient sum, one optimizer step."""

from __future__ import annotations

import pytest

from tests.unit.test_sim_symmetry import _gpt, _same
from torchweave.errors import SimError
from torchweave.policies import resolve
from torchweave.sim import parse_cluster
from torchweave.sim.simulate import simulate


@pytest.mark.parametrize("policy", ["dp", "zero1", "zero3", "tp"])
def test_each_micro_batch_adds_one_forward_and_backward(policy: str) -> None:
    g = _gpt(2, batch=4)
    cluster = parse_cluster("4xA100-80GB-SXM@2")
    plan = resolve(policy if policy != "tp" else "tp:tp=2", g, 4)
    r = {k: simulate(g, plan, cluster, grad_accum=k, timeline=False) for k in (1, 2, 4)}
    compute = {k: max(x.compute_time) for k, x in r.items()}
    comm = {k: max(x.comm_time) for k, x in r.items()}
    # busy times are affine in k: the same micro-step each time, the optimizer once
    assert compute[4] - compute[2] == pytest.approx(2 * (compute[2] - compute[1]), rel=1e-9)
    assert compute[2] > compute[1]
    if policy == "zero3":  # gathers and reduce-scatters on every micro-batch, as the runtime does
        assert comm[4] - comm[2] == pytest.approx(2 * (comm[2] - comm[1]), rel=1e-9) and comm[2] > comm[1]
    else:  # the gradient sum once per step (tp's activation collectives once per micro-step)
        grad_sync = 2 * comm[1] - comm[2]
        assert grad_sync > 0 and comm[4] - comm[2] == pytest.approx(2 * (comm[2] - comm[1]), rel=1e-9)
    assert r[4].tokens_per_step == 4 * r[1].tokens_per_step
    assert r[4].model_flops == pytest.approx(4 * r[1].model_flops)
    assert r[4].memory == r[1].memory  # one micro-batch's activations at a time
    assert r[4].step_time > r[2].step_time > r[1].step_time
    assert any("4 micro-batches accumulated" in n for n in r[4].notes)


def test_accumulating_the_batch_costs_the_whole_batch_in_less_memory() -> None:
    whole, micro = _gpt(2, batch=8), _gpt(2, batch=2)
    cluster = parse_cluster("2xA100-80GB-SXM")
    a = simulate(whole, resolve("dp", whole, 2), cluster, timeline=False)
    b = simulate(micro, resolve("dp", micro, 2), cluster, grad_accum=4, timeline=False)
    assert a.tokens_per_step == b.tokens_per_step
    assert b.model_flops == pytest.approx(a.model_flops, rel=1e-6)
    assert b.memory[0].activations < a.memory[0].activations / 2


def test_fast_paths_accumulate_like_the_exact_simulation() -> None:
    g = _gpt(8, batch=8)
    cluster = parse_cluster("8xA100-80GB-SXM@2")
    plan = resolve("zero2", g, 8)
    exact = simulate(g, plan, cluster, fold=False, symmetry=False, grad_accum=3)
    _same(simulate(g, plan, cluster, symmetry=True, fold=False, grad_accum=3), exact)
    folded = simulate(g, plan, cluster, fold=True, grad_accum=3)
    assert folded.folded_blocks == 8
    _same(folded, exact)


def test_a_pipeline_takes_its_micro_batches_from_the_plan() -> None:
    g = _gpt(2, batch=4)
    with pytest.raises(SimError, match=r"1f1b:micro=4"):
        simulate(g, resolve("1f1b", g, 2), parse_cluster("2xA100-80GB-SXM"), grad_accum=4)
    with pytest.raises(SimError, match="at least 1"):
        simulate(g, resolve("dp", g, 2), parse_cluster("2xA100-80GB-SXM"), grad_accum=0)
