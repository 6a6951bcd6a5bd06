"""The fast path for pipelined plans (``sim/fast/stagefold.py``) gives the exact simulation's results.

Every schedule on 64 simulated GPUs, with data, tensor and pipeline parallelism,
ZeRO 1 and 2, recompute and bf16: the fast path (three pipeline ranks, two
data-parallel replicas, one and two blocks a stage, extrapolated) against
lowering and simulating all 64 ranks and 24 blocks. Step time, every rank's
busy times and memory by contributor, FLOPs and the bubble agree to 0.1%.
"""

from __future__ import annotations

import functools

import pytest
import torch

from torchweave.errors import TorchweaveError
from torchweave.policies import resolve
from torchweave.sim import parse_cluster
from torchweave.sim.simulate import MemoryUse, simulate
from torchweave.sim.fast.stagefold import find_stage_shape

REL = 1e-3


@functools.lru_cache(maxsize=None)
def _gpt(d: int = 128, layers: int = 24):
    import torchweave
    from torchweave.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=layers, n_head=4, d_model=d)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.empty(64, 64, dtype=torch.long)
    return torchweave.capture(model, (idx, idx), name=f"gpt-{layers}x{d}")


def _close(fast, exact) -> None:
    assert fast.world_size == exact.world_size == 64
    assert fast.step_time == pytest.approx(exact.step_time, rel=REL)
    assert fast.compute_time == pytest.approx(exact.compute_time, rel=REL)
    assert fast.comm_time == pytest.approx(exact.comm_time, rel=REL)
    assert fast.model_flops == pytest.approx(exact.model_flops, rel=REL)
    assert fast.bubble == pytest.approx(exact.bubble, rel=REL, abs=1e-6)
    for name in MemoryUse.__dataclass_fields__:
        got = [getattr(m, name) for m in fast.memory]
        want = [getattr(m, name) for m in exact.memory]
        assert got == pytest.approx(want, rel=REL), name


CASES = [
    ("gpipe:pp=4,dp=16,micro=4", 128, "A100"),
    ("1f1b:pp=4,tp=2,dp=8,micro=8", 128, "A100"),
    ("1f1b:pp=8,tp=2,dp=4,micro=16,zero=1", 128, "A100"),
    ("interleaved:pp=4,tp=2,dp=8,micro=8,virtual=3", 128, "A100"),
    ("interleaved:pp=2,tp=4,dp=8,micro=8,virtual=2,recompute=selective", 128, "A100"),
    ("1f1b:pp=4,tp=4,dp=4,micro=8,zero=1,split=sequence", 128, "A100"),
    ("zb:pp=4,tp=2,dp=8,micro=8,zero=2", 128, "A100"),
    ("1f1b:pp=4,tp=2,dp=8,micro=8,zero=2,split=sequence", 128, "A100"),  # norms: all-reduced
    ("1f1b:pp=4,tp=4,dp=4,micro=8,recompute=full", 128, "CPU"),
    # 12.6 MB of gradients a block: several 25 MiB buckets a rank, rebucketed.
    ("1f1b:pp=4,dp=16,micro=4", 512, "A100"),
    ("interleaved:pp=2,dp=32,micro=4,virtual=3", 512, "CPU"),
]


@pytest.mark.parametrize("spec,d,device", CASES)
def test_the_stage_fast_path_agrees_with_every_rank_simulated(spec: str, d: int, device: str) -> None:
    g = _gpt(d)
    cluster = parse_cluster("64xA100-80GB-SXM@8" if device == "A100" else "64xCPU-2core@4")
    plan = resolve(spec, g, 64)
    dtype = torch.bfloat16 if device == "A100" else None
    fast = simulate(g, plan, cluster, dtype=dtype, fold=True, timeline=False)
    exact = simulate(g, plan, cluster, dtype=dtype, fold=False, timeline=False)
    assert fast.folded_blocks == 24 and exact.folded_blocks is None
    assert any("simulated as" in n for n in fast.notes)
    _close(fast, exact)


def test_large_pipelines_take_the_fast_path_by_themselves() -> None:
    g = _gpt()
    plan = resolve("1f1b:pp=4,tp=2,dp=8,micro=8", g, 64)
    res = simulate(g, plan, parse_cluster("64xA100-80GB-SXM@8"), timeline=True)
    assert res.folded_blocks == 24
    shown = {e.rank for e in res.timeline}
    assert shown == {q * 16 + j for q in range(4) for j in range(2)}  # replica 0 of each group


def test_the_shape_is_what_the_policy_built() -> None:
    g = _gpt()
    shape = find_stage_shape(g, resolve("interleaved:pp=4,tp=2,dp=8,micro=8,virtual=3", g, 64))
    assert (shape.pp, shape.virtual, shape.dp, shape.tp, shape.keep) == (4, 3, 8, 2, 2)
    assert sum(shape.per_stage) == 24 and len(shape.per_stage) == 12
    # Pipeline rank kinds: first, middle (all alike), last.
    assert [shape.kind_of(q) for q in range(4)] == [0, 1, 1, 2]
    assert shape.small_stage(4 * 2 + 3) == 2 * 3 + 2  # virtual stage 2 of the last rank


def test_plans_off_the_regular_shape_are_simulated_exactly() -> None:
    from torchweave.policies.pipeline_policy import with_schedule

    g = _gpt()
    cluster = parse_cluster("64xA100-80GB-SXM@8")
    plan = resolve("1f1b:pp=4,tp=2,dp=8,micro=8", g, 64)
    custom = with_schedule(plan, dict(plan.pipeline.schedule))  # a user's schedule
    assert find_stage_shape(g, custom) is None
    assert simulate(g, custom, cluster, fold=True, timeline=False).folded_blocks is None
    small = resolve("interlaced", _gpt(layers=8), 4)
    assert find_stage_shape(_gpt(layers=8), small) is None


def test_an_invalid_plan_is_named_for_the_model_as_it_is() -> None:
    g = _gpt()
    plan = resolve("zb:pp=4,tp=2,dp=8,micro=8,zero=3", g, 64)
    with pytest.raises(TorchweaveError) as err:
        simulate(g, plan, parse_cluster("64xA100-80GB-SXM@8"), fold=True, timeline=False)
    assert "gpt-24x128" in str(err.value) and "of 24" not in str(err.value)
    assert "zero=3 with a pipeline" in str(err.value)


@pytest.mark.parametrize("spec", ["1f1b:pp=4,tp=2,dp=8,micro=8,split=solved",
                                  "interleaved:pp=2,tp=4,dp=8,micro=8,virtual=2,split=solved"])
def test_solved_splits_take_the_fast_path_and_agree(spec: str) -> None:
    """The solver's partitions gather, scatter and exchange on the tensor-parallel group
    inside each stage; that is no data moving between replicas, so the fast path applies."""
    from tests.unit.test_search_intra import fast as free_links
    from torchweave.search import resolve as search_resolve
    from torchweave.search.intra import tp_dims

    g = _gpt()
    plan = search_resolve(spec, g, 64, cluster=free_links(64))  # solved to split everything
    rule = resolve(spec.replace(",split=solved", ""), g, 64)
    assert tp_dims(plan, g) != tp_dims(rule, g)
    cluster = parse_cluster("64xA100-80GB-SXM@8")
    fast = simulate(g, plan, cluster, dtype=torch.bfloat16, fold=True, timeline=False)
    exact = simulate(g, plan, cluster, dtype=torch.bfloat16, fold=False, timeline=False)
    assert fast.folded_blocks == 24 and exact.folded_blocks is None
    _close(fast, exact)


@pytest.mark.parametrize("spec", ["interleaved:pp=2,tp=4,dp=8,micro=8,virtual=2,zero=1,split=solved",
                                  "1f1b:pp=4,tp=2,dp=8,micro=8,split=solved"])
def test_sums_over_several_groups_are_each_costed_on_their_own(spec: str) -> None:
    """The solver's partitions keep some weights whole under split ops: their gradients sum
    over the whole stage group, the split ones' over data parallelism. The fast path
    costs each group's sums on that group (it once costed them all on the first one's,
    15% of GPT-3 175B's step on 16,384 GPUs)."""
    from torchweave.search import resolve as search_resolve

    g = _gpt(128)
    cluster = parse_cluster("64xA100-80GB-SXM@8")
    plan = search_resolve(spec, g, 64, cluster=cluster)
    fast = simulate(g, plan, cluster, dtype=torch.bfloat16, fold=True, timeline=False)
    exact = simulate(g, plan, cluster, dtype=torch.bfloat16, fold=False, timeline=False)
    assert fast.folded_blocks == 24
    _close(fast, exact)
