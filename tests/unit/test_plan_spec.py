"""Plan strings (``POLICY:KEY=VALUE,...``) for every policy, and recompute as a plan option."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import built, captured, saved_bytes, state_of
from torchweave.codegen.render import write
from torchweave.errors import TorchweaveError
from torchweave.lower.lower import lower
from torchweave.plan.validate import validate
from torchweave.policies import resolve
from torchweave.policies.recompute import with_recompute
from torchweave.policies.spec import OPTIONS, PlanSpec
from torchweave.runtime.executor import RankModule
from torchweave.runtime.groups import GroupCache
from torchweave.train.config import ParallelConfig
from torchweave.train.typed import ConfigError


def test_every_policy_takes_its_options() -> None:
    graph = captured("gpt-tiny")
    plan = resolve("tp:tp=2,zero=1", graph, 4)
    assert plan.mesh.dim("tp") == 2 and plan.mesh.dim("dp") == 2 and plan.zero == 1
    assert resolve("sp:dp=2", graph, 4).mesh.dim("tp") == 2
    assert resolve("dp:zero=2", graph, 4).zero == 2 and resolve("zero3:dp=4", graph, 4).zero == 3
    plan = resolve("interleaved:tp=2,pp=2,virtual=2,micro=4,recompute=selective", graph, 4)
    assert plan.pipeline.stages == 4 and plan.pipeline.micro_batches == 4 and plan.recompute
    assert plan.notes["spec"] == "interleaved:tp=2,pp=2,virtual=2,micro=4,recompute=selective"
    assert resolve("interlaced:micro=4", graph, 2).pipeline.micro_batches == 4
    assert set(OPTIONS) >= {"dp", "zero1", "zero2", "zero3", "tp", "sp", "gpipe", "1f1b",
                            "interleaved", "zb", "interlaced"}


@pytest.mark.parametrize("text, words", [
    ("1f1b:virtual=3", ["option 'virtual'", "1f1b takes pp, tp, dp, micro", "only the interleaved"]),
    ("dp:tp=2", ["option 'tp'", "dp takes dp, zero, recompute"]),
    ("1f1b:zero=4", ["zero=4", "0, 1, 2 or 3"]),
    ("1f1b:micro=0", ["micro=0", "at least 1"]),
    ("1f1b:micro=2,micro=4", ["given once"]),
    ("1f1b:micro", ["KEY=VALUE"]),
    ("pipedream:pp=2", ["'pipedream:pp=2'", "POLICY one of dp, zero1"]),
    ("dp:recompute=a.b", ["module names joined by '+'"]),
])
def test_a_bad_option_is_refused_before_any_graph_with_what_is_allowed(text, words) -> None:
    with pytest.raises(TorchweaveError) as info:
        PlanSpec.parse(text)
    for w in words:
        assert w in str(info.value), str(info.value)


def test_options_that_do_not_fit_the_world_name_both_sizes() -> None:
    graph = captured("gpt-tiny")
    with pytest.raises(TorchweaveError, match=r"dp = world_size \(4\)"):
        resolve("dp:dp=2", graph, 4)
    with pytest.raises(TorchweaveError, match=r"tp × dp = world_size \(4\)(.|\n)*run on 8 ranks"):
        resolve("tp:tp=2,dp=4", graph, 4)
    with pytest.raises(TorchweaveError, match=r"= 4 != world_size\(2\)(.|\n)*run on 4 ranks"):
        resolve("1f1b:tp=2,pp=2", graph, 2)
    with pytest.raises(TorchweaveError) as info:  # not a mode, not a module of the model
        resolve("1f1b:recompute=everything", graph, 2)
    for w in ("none, full, selective", "no module 'everything'", "attn", "mlp"):
        assert w in str(info.value), str(info.value)


def test_split_sequence_is_sequence_parallelism_with_or_without_a_pipeline() -> None:
    graph = captured("gpt-tiny")
    plain, seq = resolve("tp:tp=2", graph, 4), resolve("tp:tp=2,split=sequence", graph, 4)
    assert seq.trans == resolve("sp:tp=2", graph, 4).trans and seq.trans != plain.trans
    piped = resolve("1f1b:tp=2,pp=2,split=sequence", graph, 4)
    assert "sequence" in piped.notes["policy"]
    # inside each stage group of 2, the ops split as sp splits them (the norms on the sequence)
    group, group_plain = resolve("sp:tp=2", graph, 2), resolve("tp:tp=2", graph, 2)
    norms = [n.name for n in graph.nodes if "layer_norm" in n.target]
    assert norms and all(piped.trans[n] == group.trans[n] for n in norms)
    assert all(piped.trans.get(n) != group_plain.trans.get(n) for n in norms)
    with pytest.raises(TorchweaveError, match="split is one of rule, solved, sequence"):
        PlanSpec.parse("1f1b:split=seq")


def test_accum_is_a_plan_option_kept_in_plan_json_and_checked_as_data(tmp_path) -> None:
    from torchweave.plan.plan import Plan
    from torchweave.policies.spec import accum_of, merged_accum

    graph = captured("gpt-tiny")
    plan = resolve("zero2:accum=2", graph, 2)
    assert plan.accum == 2 and Plan.from_json(plan.to_json()).accum == 2
    assert '"accum"' not in resolve("zero2", graph, 2).to_json()  # 1: not written
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert accum_of(str(path)) == 2 and accum_of("tp:accum=4") == 4 and accum_of("auto") == 1
    assert merged_accum("dp:accum=2", 1) == 2 == merged_accum("dp", 2) == merged_accum("dp:accum=2", 2)
    with pytest.raises(TorchweaveError, match="the plan says accum=2"):
        merged_accum("dp:accum=2", 4)
    for bad in ('"4"', "0", "true", "2.5", '"__import__(\'os\')"'):  # data, never code
        text = plan.to_json().replace('"accum": 2', f'"accum": {bad}')
        with pytest.raises(TorchweaveError, match="a whole number of at least 1"):
            Plan.from_json(text)
    piped = resolve("1f1b:micro=2", graph, 2)
    piped.accum = 2
    with pytest.raises(TorchweaveError, match="takes its micro-batches from its pipeline"):
        validate(piped, graph)


def test_a_pipeline_given_pp_and_tp_takes_the_rest_as_data_parallel() -> None:
    graph = captured("gpt-tiny")
    plan = resolve("1f1b:pp=2,micro=2", graph, 4)
    assert plan.mesh.axes == (("pp", 2), ("dp", 2), ("tp", 1))
    assert PlanSpec.parse("zb:tp=2,pp=2").dp(16) == 4
    assert PlanSpec.parse("zb:tp=2").dp(16) == 1  # no pp: pp = world / (dp * tp)


def test_the_train_config_reads_the_same_strings() -> None:
    assert ParallelConfig(plan="tp:tp=2", world_size=4, micro_batch=2, global_batch=4).dp == 2
    assert ParallelConfig(plan="1f1b:dp=2,tp=1", world_size=4, micro_batch=2, global_batch=4).dp == 2
    assert ParallelConfig(plan="zero3:recompute=full", world_size=2, micro_batch=2, global_batch=4).dp == 2
    with pytest.raises(ConfigError, match="parallel.plan.*micro=0"):
        ParallelConfig(plan="1f1b:micro=0", world_size=2)


def test_full_selective_and_module_recompute_groups() -> None:
    graph = captured("gpt-tiny")
    by_name = {n.name: n for n in graph.nodes}
    full = resolve("dp:recompute=full", graph, 2).recompute
    blocks = sorted({n.module.split(".")[1] for n in graph.nodes if n.module.startswith("blocks.")})
    assert len(full) == len(blocks)
    assert all(len({by_name[x].module.split(".")[1] for x in g}) == 1 for g in full)
    selective = resolve("dp:recompute=selective", graph, 2).recompute
    assert len(selective) == len(blocks)
    params = {v for v, val in graph.values.items() if val.kind == "param"}
    for g in selective:  # the attention core: no projection, the attention op first
        assert "scaled_dot_product_attention" in by_name[g[0]].target
        assert not any(r.name in params for x in g for r in by_name[x].input_refs())
    assert len(resolve("dp:recompute=mlp+attn", graph, 2).recompute) == 2 * len(blocks)
    assert resolve("dp:recompute=none", graph, 2).recompute == []


def test_selective_finds_a_hand_written_attention_core() -> None:
    graph = captured("llama-tiny")
    groups = resolve("dp:recompute=selective", graph, 2).recompute
    targets = [{next(n for n in graph.nodes if n.name == x).target for x in g} for g in groups]
    assert groups and all(t & {"aten._softmax.default", "aten.softmax.int",
                               "aten.scaled_dot_product_attention.default"} for t in targets)


def test_recompute_groups_stop_at_pipeline_stages() -> None:
    graph = captured("gpt-tiny")
    plan = resolve("1f1b:pp=2", graph, 2)
    middle = next(i for i, n in enumerate(graph.nodes) if n.module.startswith("blocks.0.mlp"))
    from torchweave.policies.pipeline_policy import pipeline

    plan = pipeline(graph, 2, schedule="1f1b", cuts=[middle])  # a cut inside block 0
    with_recompute(plan, graph, "full")
    for g in plan.recompute:
        assert len({plan.pipeline.stage_of[x] for x in g}) == 1
    assert len(plan.recompute) == 3  # block 0 in two pieces, block 1 whole


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_keeps_less_and_computes_the_same(tmp_path, mode) -> None:
    model, inputs = built("gpt-tiny")[:2]
    graph = captured("gpt-tiny")
    state = {k: v.detach() for k, v in state_of(model).items()}
    group_cache = GroupCache(rank=0, world_size=1, timeout_s=5.0, device=torch.device("cpu"))
    out = []
    for spec in ("dp", f"dp:recompute={mode}"):
        plan = resolve(spec, graph, 1)
        (path,) = write(lower(graph, plan), str(tmp_path / spec.replace(":", "_").replace("=", "_")))
        module = RankModule(lower(graph, plan)[0], path, state, group_cache)
        saved = saved_bytes(module, inputs)
        loss = module.backward_step(*inputs)
        out.append((saved, loss, {p: t.grad.clone() for p, t in module.params.items() if t.grad is not None}))
    (s0, l0, g0), (s1, l1, g1) = out
    assert s1 < s0, (s1, s0)
    assert l0 == l1
    for p in g0:
        torch.testing.assert_close(g1[p], g0[p], rtol=1e-6, atol=1e-8)


def test_the_simulator_sees_what_each_recompute_keeps() -> None:
    from torchweave.sim import simulate
    from torchweave.sim.hardware.cluster import parse_cluster

    graph = captured("gpt-tiny")
    cluster = parse_cluster("2xA100-80GB-SXM")
    res = {m: simulate(graph, resolve(f"dp:recompute={m}", graph, 2), cluster, timeline=False)
           for m in ("none", "selective", "full")}
    acts = {m: r.memory[0].activations for m, r in res.items()}
    assert acts["full"] < acts["selective"] < acts["none"], acts
    steps = {m: r.step_time for m, r in res.items()}
    assert steps["none"] < steps["selective"] < steps["full"], steps  # each pays its forward again


def test_full_recompute_keeps_each_blocks_input_with_or_without_tensor_parallelism() -> None:
    """As codegen's checkpointed runs keep them: every block's input (the one before made
    in another group), and nothing a collective makes inside a block's run. The simulator
    once dropped the inputs of blocks after the first and kept the tensor-parallel
    all-reduces' outputs (2.5x the activations of the same plan without tp)."""
    from torchweave.sim import simulate
    from torchweave.sim.hardware.cluster import parse_cluster

    graph = _gpt_meta_graph()
    cluster = parse_cluster("8xA100-80GB-SXM")
    one_input = 2 * 256 * 1024 * 2  # one micro-batch's block input, bf16: 1 MiB
    acts = {}
    for spec in ("1f1b:pp=4,micro=2,recompute=full", "1f1b:pp=4,tp=2,micro=2,recompute=full"):
        plan = resolve(spec, graph, 8 if "tp=2" in spec else 4)
        res = simulate(graph, plan, cluster, dtype=torch.bfloat16, timeline=False, fold=False)
        acts[spec] = [m.activations for m in res.memory]
    plain, tp = acts.values()
    # a middle stage: 2 blocks, 2 micro-batches in flight on its first rank
    assert plain[1] == pytest.approx(2 * 2 * one_input, rel=0.02)
    assert tp[2] == tp[3] == pytest.approx(plain[1], rel=0.02)


def _gpt_meta_graph():
    import torchweave
    from torchweave.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=512, block_size=256, n_layer=8, n_head=8, d_model=1024)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.zeros(4, 256, dtype=torch.long)
    return torchweave.capture(model, (idx, idx))


def test_a_plan_that_replicates_much_of_its_work_says_so(capsys) -> None:
    """moe-tiny's expert einsum has no split under dp: every rank runs all of it."""
    from torchweave.cli import main
    from torchweave.plan.show import REPLICATION_NOTE, replicated_flops, replication_note

    moe, gpt = captured("moe-tiny"), captured("gpt-tiny")
    share, ranked = replicated_flops(resolve("dp", moe, 2), moe)
    assert share > REPLICATION_NOTE and ranked[0][0] == "aten.einsum.default"
    assert "of the forward FLOPs run replicated under 'dp' (aten.einsum.default" in \
        replication_note(resolve("dp", moe, 2), moe)
    assert replication_note(resolve("dp", gpt, 2), gpt) == ""
    assert replicated_flops(resolve("tp", gpt, 2), gpt)[0] < REPLICATION_NOTE  # layer norms only
    assert main(["plan", "moe-tiny", "--plan", "dp", "--world-size", "2"]) == 0
    assert "run replicated under 'dp'" in capsys.readouterr().out
    from torchweave.verify import Report

    note = replication_note(resolve("dp", moe, 2), moe)
    assert note in str(Report("dp", 2, 1, 1e-5, losses=[(1.0, 1.0)], replicated=note))
