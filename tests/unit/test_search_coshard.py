"""Co-shard in the plan search: a point of the space, found where memory needs it."""

from __future__ import annotations

import pytest
import torch

from torchweave.errors import TorchweaveError
from torchweave.search import Constraints, load_constraints, search
from torchweave.search.space import points
from torchweave.sim import parse_cluster


def test_co_shard_is_in_the_space_and_found_where_memory_needs_it() -> None:
    """A 65k-vocabulary head dwarfs four small blocks: on 2 devices with 0.5 GiB each, no
    dp, ZeRO, tp or block recompute plan fits, and only the head in chunks does
    (simulated: dp 0.92 GiB, zero3 0.85, tp 0.86, dp with full recompute 0.89, the head
    in 4 chunks 0.30). Without co-shard in the space the search says what to relax."""
    import torchweave
    from torchweave.models.gpt import GPT, GPTConfig
    from torchweave.search.space import Point

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=65536, block_size=256, n_layer=4, n_head=4, d_model=128))
        idx = torch.zeros(16, 256, dtype=torch.long)
    g = torchweave.capture(model, (idx, idx), name="gpt-wide-head")
    cluster = parse_cluster("2xA100-80GB-SXM@2")
    c = Constraints(memory_gib=0.5, schedules=("none",), recompute=("none", "full"), coshard=(0, 2, 4))
    res = search(g, cluster, c, top=3, dtype=torch.bfloat16)
    assert res.best.point.coshard in (2, 4), res.best.spec
    assert f"coshard={res.best.point.coshard}" in res.best.spec
    assert max(m.peak for m in res.best.result.memory) <= 0.5 * 2**30
    assert "coshard" in res.best.plan.notes
    with pytest.raises(TorchweaveError, match="co-shard the output head"):
        search(g, cluster, c.with_(coshard=(0,)), dtype=torch.bfloat16)
    # arithmetic pruning: chunks that do not split a device's samples are not points
    pts, _ = points(2, 16, 4, c.with_(coshard=(0, 16)))
    assert all(p.coshard in (0,) for p in pts if p.dp == 2)
    assert Point(1, 1, 2, 1, "none", 1, "none", 0, False, "rule", 4).spec == "dp:coshard=4"


def test_constraints_read_coshard_from_yaml(tmp_path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("preset: megatron\ncoshard: [0, 4]\n")
    assert load_constraints(str(f)).coshard == (0, 4)
    f.write_text("coshard: [3]\n")
    with pytest.raises(TorchweaveError, match="line 1.*coshard"):
        load_constraints(str(f))


@pytest.mark.parametrize("tp,sp,recompute", [(2, False, "none"), (2, True, "selective"),
                                             (4, False, "full")])
def test_a_co_sharded_proxy_built_from_its_sibling_equals_one_simulated_whole(tp, sp, recompute):
    """Co-sharding touches the head only, so a co-sharded proxy simulates the 3-block model
    alone and takes what a block adds from its ``coshard=0`` sibling: every number equals the
    proxy that simulates the 4-block model too."""
    import torchweave
    from torchweave.models.gpt import GPT, GPTConfig
    from torchweave.policies.spec import PlanSpec
    from torchweave.search.proxies import proxy
    from torchweave.sim.fast.fold import find_blocks, with_twin

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=8192, block_size=128, n_layer=6, n_head=4, d_model=128))
        idx = torch.zeros(16, 128, dtype=torch.long)
    g = torchweave.capture(model, (idx, idx), name="gpt-head")
    base = PlanSpec.parse("dp").build(g, 1)
    blocks = with_twin(g, base, find_blocks(g, base, least=4, nested=False))
    cluster = parse_cluster("8xA100-80GB-SXM@8")
    kw = dict(dtype=torch.bfloat16, precision="bf16-mixed")
    sib = proxy(g, blocks, cluster, tp, sp, recompute, **kw)
    whole = proxy(g, blocks, cluster, tp, sp, recompute, coshard=4, **kw)
    made = proxy(g, blocks, cluster, tp, sp, recompute, coshard=4, like=sib, **kw)
    assert whole.rest_act != sib.rest_act  # the head in chunks keeps less: a real difference
    for f in ("block_s", "rest_s", "block_act", "rest_act", "block_params", "rest_params",
              "block_comm", "rest_comm", "block_lat", "rest_lat", "boundary_bytes", "reads", "tied",
              "tied_copied"):
        a, b = getattr(whole, f), getattr(made, f)
        assert a == pytest.approx(b, rel=1e-9, abs=1e-15), f
    assert made.plan.notes.get("coshard") == whole.plan.notes.get("coshard")
    assert len(made.plan.trans) == len(whole.plan.trans)  # the 4-block model's plan
