"""Expert parallelism in the search's space: points for models with expert parameters only,
ranked by the simulator like any other; presets and constraints say which degrees."""

from __future__ import annotations

import pytest

from tests.conftest import captured
from torchweave.errors import TorchweaveError
from torchweave.policies import resolve
from torchweave.policies.expert import expert_count
from torchweave.search import load_constraints, preset, search
from torchweave.search.estimate import estimable
from torchweave.search.space import points
from torchweave.sim import parse_cluster


def test_expert_points_join_the_space_of_models_with_experts_only() -> None:
    assert expert_count(captured("moe-tiny")) == 4 and expert_count(captured("gpt-tiny")) == 0
    assert expert_count(captured("vit-tiny")) == 0  # a convolution's output channels are not experts
    pts, _ = points(4, 4, 2, preset("free"), experts=4)
    eps = [p for p in pts if p.ep > 1]
    assert {p.ep for p in eps} == {2, 4} and all(estimable(p) for p in eps)
    for p in eps:  # each is a plan string that builds on the model
        plan = resolve(p.spec, captured("moe-tiny"), 4)
        assert plan.notes["experts"].startswith("4 expert ops"), p.spec
    assert not [p for p in points(4, 4, 2, preset("free"))[0] if p.ep > 1]
    assert {p.ep for p in points(8, 8, 2, preset("free"), experts=4)[0]} == {1, 2, 4}  # ep | experts
    for name, scheds in (("free", {"none", "gpipe", "1f1b", "interleaved", "zb"}),
                         ("megatron", {"none", "1f1b", "interleaved"})):  # every pipeline schedule
        eps = [p for p in points(8, 16, 4, preset(name), experts=4)[0] if p.ep > 1]
        assert {p.schedule for p in eps} == scheds, name
        assert all(p.virtual == 2 and p.micro % p.pp == 0 for p in eps if p.schedule == "interleaved")
    for name in ("dp", "zero3", "nnscaler", "alpa"):
        assert not [p for p in points(4, 4, 2, preset(name), experts=4)[0] if p.ep > 1], name


def test_expert_points_are_priced_by_a_proxy_planned_with_ep() -> None:
    """An expert-parallel point is estimated from a proxy planned with ``ep`` (experts and
    batch over ep, on ``ep · tp`` devices), its expert gradients summed over dp only: the
    estimate is within 5% of the event simulator, with and without a pipeline, dp and tp."""
    import torch

    import torchweave
    from torchweave.models.moe import MoEConfig, MoEGPT
    from torchweave.policies.spec import PlanSpec
    from torchweave.search.estimate import estimate
    from torchweave.search.proxies import proxy
    from torchweave.search.space import Point
    from torchweave.search.timed import Timing
    from torchweave.sim.fast.fold import find_blocks
    from torchweave.sim.simulate import simulate

    cfg = MoEConfig(vocab_size=8192, block_size=1024, n_layer=8, n_head=8, d_model=2048,
                    ffn_hidden=4096, n_expert=8, top_k=2, group_size=1024)
    with torch.device("meta"):  # steps of 0.1 s: a small model's, of milliseconds, is latency
        model, idx = MoEGPT(cfg), torch.zeros(64, 1024, dtype=torch.long)
    g = torchweave.capture(model, (idx, idx))
    cluster = parse_cluster("16xA100-80GB-SXM@8")
    blocks = find_blocks(g, PlanSpec.parse("dp").build(g, 1), least=4)
    assert blocks is not None and len(blocks) == 8  # the load-balancing sum is inside each block
    for pt in (Point(1, 1, 2, 1, "none", 1, "none", 1, False, ep=8),
               Point(1, 1, 2, 1, "none", 1, "none", 2, False, ep=8),
               Point(2, 1, 1, 1, "none", 1, "none", 1, False, ep=8),  # dp 1: no ZeRO group
               Point(1, 1, 2, 1, "none", 1, "none", 0, False, ep=8),
               Point(2, 1, 2, 1, "none", 1, "none", 0, False, ep=4),
               Point(1, 2, 2, 8, "1f1b", 1, "none", 0, False, ep=4)):
        px = proxy(g, blocks, cluster, pt.tp, False, "none", dtype=torch.bfloat16,
                   precision="bf16-mixed", ep=pt.ep)
        assert 0 < px.expert_params < px.block_params
        # a pipelined point, as the search prices it: its schedule on its stages' costs
        timed = Timing(g, blocks, cluster, torch.bfloat16, 64).price([(pt, px)], len(blocks)) \
            if pt.pp > 1 else {}
        est = estimate(pt, px, cluster, len(blocks), precision="bf16-mixed",
                       schedule_s=timed.get(pt))
        sim = simulate(g, PlanSpec.parse(pt.spec).build(g, 16), cluster, dtype=torch.bfloat16,
                       timeline=False)
        assert abs(est.step_s / sim.step_time - 1) < 0.05, (pt.spec, est, sim.step_time)
        # ZeRO shards the experts over dp (the plan's zero_axis) and keeps the rest whole, as
        # the runtime does; sharding everything over dp × ep put the estimate 30-60% over
        assert abs(est.memory / max(sim.peak_memory) - 1) < 0.10, (pt.spec, est.memory,
                                                                    sim.peak_memory)


def test_an_ep_that_does_not_divide_the_experts_is_refused() -> None:
    with pytest.raises(TorchweaveError, match="ep divides the model's 4 experts"):
        resolve("ep:ep=8", captured("moe-tiny"), 8)
    from torchweave.policies.spec import PlanSpec

    assert PlanSpec.parse("ep:tp=2").dp(4) == 2  # sample groups: the batch splits over dp × ep


def test_the_search_simulates_expert_points(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("preset: free\ntp: [1]\npp: [1]\nep: [2, 4]\nrecompute: [none]\nzero: [0]\n"
                    "coshard: [0]\nsplit: [rule]\n")
    result = search(captured("moe-tiny"), parse_cluster("4xA100-80GB-SXM@4"), load_constraints(path),
                    top=5)
    specs = [r.spec for r in result.ranked]
    assert "ep:ep=2,dp=2,tp=1" in specs and "ep:ep=4,dp=1,tp=1" in specs and "dp" in specs
    assert all(r.result.step_time > 0 for r in result.ranked)


def test_a_bad_ep_degree_names_its_line(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("tp: [1]\nep: [two]\n")
    with pytest.raises(TorchweaveError, match="line 2"):
        load_constraints(path)


def test_the_plan_command_says_what_ep_split(capsys) -> None:
    from torchweave.cli import main

    assert main(["plan", "moe-tiny", "--plan", "ep:ep=2", "--world-size", "4"]) == 0
    assert "experts: 4 expert ops split over ep=2" in capsys.readouterr().out
    assert main(["plan", "gpt-tiny", "--plan", "ep", "--world-size", "2"]) == 0
    assert "ep runs as data parallelism" in capsys.readouterr().out
