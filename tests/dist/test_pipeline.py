"""Every pipeline schedule and hybrid matches one device (real gloo ranks, no mocks).

Multi-forward plans (``recycle=P``) are compared with the one-device recycling
loop (:func:`torchweave.verify.recycled_forward`).

Loss at every step, every gradient after the first backward and every
parameter after the optimizer steps, against the model trained on one device
over the same micro-batches. One launch per world size runs all its cases,
each twice: with tagged messages and untagged (every message with tag 0, as
NCCL runs them: only the order of each pair's messages matches them).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from tests.conftest import built
from torchweave.runtime.executor import StepConfig
from torchweave.verify import BF16_TOLERANCE, Case, verify_many


def _batch8(name: str):
    """The tiny model with its example batch doubled to 8 (micro-batches of 1 or 2)."""
    model, inputs = _t5_3x3() if name == "t5-3x3" else built(name)[:2]
    return model, tuple(torch.cat([x, x.flip(0)]) for x in inputs)


def _t5_3x3():
    """A T5 of 3 + 3 layers: cut into 4 stages, its decoder embedding (a lookup of the
    vocabulary stage 0 holds) lands on a later stage, which ``tied=send`` moves to stage 0."""
    from torchweave.models.t5 import T5, T5Config

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=512, block_size=16, d_model=32, d_kv=8, n_head=4, d_ff=64,
                   n_enc_layer=3, n_dec_layer=3)
    src, tgt = torch.randint(0, 512, (4, 16)), torch.randint(0, 512, (4, 8))
    return T5(cfg), (src, tgt, tgt)


def _mid_block_cuts(graph, world_size):
    """Interleaved stages cut inside block 0: stage 2 reads stage 0's output on one rank."""
    from torchweave.policies.pipeline_policy import pipeline

    names = [n.name for n in graph.nodes]
    cuts = [names.index("layer_norm"), names.index("add_1"), names.index("layer_norm_2")]
    return pipeline(graph, world_size, schedule="interleaved", micro=2, cuts=cuts)


def _recompute(graph, world_size):
    from torchweave.policies import resolve
    from torchweave.policies.recompute import with_recompute

    return with_recompute(resolve("1f1b", graph, world_size), graph, ("mlp", "attn"))


def _coshard(graph, world_size):
    """1F1B with block 1's MLP co-sharded 4 ways on its one device."""
    from torchweave.policies import resolve
    from torchweave.policies.coshard import with_coshard

    chain = [n.name for n in graph.nodes if n.module.startswith("blocks.1.mlp")][:4]
    return with_coshard(resolve("1f1b", graph, world_size), graph, chain, 4, "n")


def _orders(graph, world_size):
    """1F1B reordered by user op-order: each rank runs every forward before its first backward."""
    from torchweave.plan.schedules import Action
    from torchweave.policies import resolve
    from torchweave.policies.pipeline_policy import with_schedule

    plan = resolve("1f1b", graph, world_size)
    m = plan.pipeline.micro_batches
    orders = [(Action.parse(f"{r}F{m - 1}"), Action.parse(f"{r}B0")) for r in range(world_size)]
    return with_schedule(plan, plan.pipeline.schedule, orders=orders)


CASES = {
    2: [("gpt-tiny", "gpipe"), ("gpt-tiny", "1f1b"), ("gpt-tiny", "interleaved"), ("gpt-tiny", "zb"),
        ("gpt-tiny", "mid-block"), ("gpt-tiny", "recompute"), ("gpt-tiny", "1f1b+clip"),
        ("gpt-tiny", "coshard"), ("gpt-tiny", "orders"), ("gpt-tiny", "interlaced"),
        ("llama-tiny", "1f1b"), ("recycler-tiny", "1f1b:micro=4,recycle=3"),
        ("recycler-tiny", "gpipe:pp=1,dp=2,micro=2,recycle=2")],
    4: [("gpt-tiny", "1f1b"), ("gpt-tiny", "interleaved"), ("gpt-tiny", "zb"),
        ("gpt-tiny", "1f1b:tp=2"), ("llama-tiny", "1f1b:tp=2,split=sequence"),
        ("t5-tiny", "1f1b:tp=2,split=sequence"),
        # a tied embedding and LM head on two stages, each keeping a copy, with ZeRO-2
        # sharding the rest (the copies are summed across stages, not by ZeRO)
        ("hf-gpt2-tiny", "1f1b:dp=2,zero=2"),
        ("gpt-tiny", "gpipe:dp=2,zero=1"), ("llama-tiny", "interlaced"), ("t5-tiny", "interlaced"),
        ("recycler-tiny", "1f1b:tp=2,recycle=3"), ("recycler-tiny", "interleaved:micro=4,recycle=2"),
        ("gpt-tiny", "interleaved:dp=2+buckets"),
        # the decoder embedding run on the vocabulary's stage, its output sent on (no copy)
        ("t5-3x3", "1f1b:pp=4,micro=4,tied=send"), ("t5-3x3", "zb:pp=4,micro=4,tied=send"),
        ("t5-3x3", "interleaved:pp=2,dp=2,micro=2,zero=1,tied=send"),
        # stages that start inside blocks, named by module (the search's seconds cut)
        ("t5-3x3", "1f1b:pp=4,micro=4,tied=send,cuts=encoder.1.ff+decoder.0.cross_attn+decoder.2")],
    8: [("gpt-tiny", "1f1b:dp=2,tp=2,zero=1"), ("llama-tiny", "interleaved:dp=2,tp=2,zero=2"),
        ("gpt-tiny", "zb:dp=2,tp=2,zero=1"), ("recycler-tiny", "zb:dp=2,tp=2,zero=1,recycle=2")],
}
SPECIAL = {"mid-block": _mid_block_cuts, "recompute": _recompute, "1f1b+clip": "1f1b",
           "coshard": _coshard, "orders": _orders, "interleaved:dp=2+buckets": "interleaved:dp=2"}
SMALL_BUCKETS = StepConfig(bucket_mb=0.02)
"""About 5k floats: gpt-tiny's gradients in several buckets per stage, so that sums start mid-step."""


TAGS = ("tagged", "untagged")


@functools.lru_cache(maxsize=None)
def reports(world_size: int) -> dict[tuple[str, str, str], object]:
    cases, keys = [], []
    for name, plan in CASES[world_size]:
        model, inputs = _batch8(name)
        config = {"+clip": StepConfig(clip_grad_norm=0.05), "+buckets": SMALL_BUCKETS}.get(
            plan[plan.rfind("+"):] if "+" in plan else "", StepConfig())
        for tags in TAGS:
            cases.append(Case(model, inputs, SPECIAL.get(plan, plan), steps=2,
                              config=dataclasses.replace(config, p2p_tags=tags), name=f"{name}/{plan}/{tags}"))
            keys.append((name, plan, tags))
    return dict(zip(keys, verify_many(cases, world_size=world_size)))


def _check(world_size: int, name: str, plan: str, tags: str) -> None:
    report = reports(world_size)[(name, plan, tags)]
    assert report.ok, str(report)
    assert len(report.losses) == 2 and report.grads and report.params
    if "pp=1" not in plan:  # one stage group: every recycled value stays on its rank
        assert report.comm.get("p2p/fwd", 0) > 0 or report.comm.get("p2p/bwd", 0) > 0, report.comm


@pytest.mark.dist
@pytest.mark.parametrize("tags", TAGS)
@pytest.mark.parametrize("name,plan", CASES[2])
def test_pipeline_2_ranks_matches_one_device(name: str, plan: str, tags: str) -> None:
    _check(2, name, plan, tags)


@pytest.mark.dist
@pytest.mark.parametrize("tags", TAGS)
@pytest.mark.parametrize("name,plan", CASES[4])
def test_pipeline_4_ranks_matches_one_device(name: str, plan: str, tags: str) -> None:
    _check(4, name, plan, tags)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("tags", TAGS)
@pytest.mark.parametrize("name,plan", CASES[8])
def test_hybrid_pp_tp_dp_zero_8_ranks_matches_one_device(name: str, plan: str, tags: str) -> None:
    _check(8, name, plan, tags)


def _overlap_rank(ctx, plans: tuple[str, ...]) -> dict[str, object]:
    import torchweave

    model, inputs = _batch8("gpt-tiny")
    out: dict[str, object] = {}
    for plan in plans:
        for overlap in (True, False):
            config = StepConfig(bucket_mb=SMALL_BUCKETS.bucket_mb, overlap=overlap)
            module = torchweave.parallelize(model, inputs, plan=plan, groups=ctx.groups, config=config)
            losses = [module.train_step(*inputs) for _ in range(2)]
            out[f"{plan}/{overlap}"] = (losses, module.state_pieces(), module.stats.early_buckets,
                                        len(module.sync.buckets))
    return out


@pytest.mark.dist
def test_gradient_sums_start_during_the_schedule_and_change_nothing() -> None:
    """pp × dp: a stage's gradient buckets start as soon as its last backward is done.

    Interleaved: rank 0 runs stages 0 and 2, and stage 2's last ``B`` comes
    before stage 0's, so its sums start while stage 0 still computes. ZB: the
    last ``W`` accumulates by hand, and its buckets start right after it. With
    and without overlap, the steps give bit-identical losses and parameters.
    """
    from torchweave.runtime.launch import LaunchConfig, spawn

    plans = ("interleaved:dp=2", "zb:dp=2")
    per_rank = spawn(_overlap_rank, LaunchConfig(world_size=4, timeout_s=120.0), plans)
    for rank, out in enumerate(per_rank):
        for plan in plans:
            (l1, p1, early, n), (l0, p0, _, _) = out[f"{plan}/True"], out[f"{plan}/False"]
            assert n > 1, f"rank {rank} {plan}: want several buckets, got {n}"
            assert l1 == l0, (rank, plan, l1, l0)
            assert p1.keys() == p0.keys()
            for k in p1:
                assert torch.equal(p1[k][1], p0[k][1]), f"rank {rank} {plan}: {k} differs with overlap"
    stage2 = [out["interleaved:dp=2/True"][2] for out in per_rank[:2]]  # ranks 0 and 1 run stages 0 and 2
    assert all(e > 0 for e in stage2), f"stage 2's buckets should start before the last action: {stage2}"


def _loss_rank(ctx, plans: tuple[str, ...]) -> dict[str, object]:
    import torchweave

    out: dict[str, object] = {}
    for plan in plans:
        model, inputs = _batch8("recycler-tiny" if "recycle" in plan else "gpt-tiny")
        for direct in (True, False):
            module = torchweave.parallelize(model, inputs, plan=plan, groups=ctx.groups)
            senders = module.loss_messages.senders
            if not direct:
                module.loss_messages = None  # the terms summed by one all-reduce, as on NCCL
            out[f"{plan}/{direct}"] = ([module.train_step(*inputs) for _ in range(3)], senders)
    return out


@pytest.mark.dist
def test_the_loss_reaches_every_rank_by_message_as_by_all_reduce() -> None:
    """On gloo each loss term is sent to every rank once its last micro-batch's forward has
    run, by the lowest rank holding it; every rank then reports the loss the all-reduce
    gives (to float64 rounding of a replicated term's mean)."""
    from torchweave.runtime.launch import LaunchConfig, spawn

    plans = ("gpipe:pp=2,dp=2", "1f1b:tp=2,pp=2", "zb:pp=4", "interleaved:micro=4,recycle=2")
    per_rank = spawn(_loss_rank, LaunchConfig(world_size=4, timeout_s=120.0), plans)
    for plan in plans:
        senders = per_rank[0][f"{plan}/True"][1]
        assert all(out[f"{plan}/True"][1] == senders for out in per_rank), plan
        # dp=2: two terms, each from its replica's last stage; tp=2: one term, held twice
        assert len(senders) == (2 if "dp=2" in plan else 1), (plan, senders)
        ref, first = per_rank[-1][f"{plan}/False"][0], per_rank[0][f"{plan}/True"][0]
        assert len(set(first)) == len(first), f"{plan}: the steps' losses should differ: {first}"
        for rank, out in enumerate(per_rank):
            direct, reduced = out[f"{plan}/True"][0], out[f"{plan}/False"][0]
            assert reduced == ref, (plan, rank, reduced, ref)
            assert direct == first, (plan, rank, direct, first)  # bit-identical on every rank
            assert direct == pytest.approx(reduced, rel=1e-12, abs=0), (plan, rank, direct, reduced)


@pytest.mark.dist
def test_pipelines_in_bf16_match_the_bf16_reference() -> None:
    """bf16 compute, fp32 master weights: messages and their gradients travel in bf16.
    Against the one-device bf16 recipe (``BF16_TOLERANCE``); 1f1b on 2 ranks runs the
    same bf16 ops in the same order as one device, so it matches it to rounding."""
    model, inputs = _batch8("llama-tiny")
    cases = [Case(model, inputs, plan, steps=2, config=StepConfig(precision="bf16", p2p_tags=tags),
                  name=f"{plan}/bf16/{tags}") for plan in ("1f1b", "interlaced") for tags in TAGS]
    reports = verify_many(cases, world_size=2, tolerance=BF16_TOLERANCE)
    for report in reports:
        assert report.ok, str(report)
    for report in reports[:len(TAGS)]:  # 1f1b
        assert report.max_grad_diff < 1e-6 and report.max_param_diff < 1e-6, str(report)
