"""Pipelined plans on CPU, no processes: stages, schedules, checks, segments, recompute."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_grads_match_model, built, captured, saved_bytes, state_of
from torchweave.codegen.render import render, write
from torchweave.errors import TorchweaveError
from torchweave.lower.lower import lower
from torchweave.ops import info
from torchweave.plan.plan import Plan
from torchweave.plan.schedules import (
    Action, Kind, ScheduleError, add_communication, dry_run, peak_in_flight, to_csv,
)
from torchweave.plan.validate import PlanError, validate
from torchweave.policies import resolve
from torchweave.policies.pipeline_policy import pipeline, with_schedule
from torchweave.policies.recompute import with_recompute
from torchweave.runtime.executor import RankModule
from torchweave.runtime.groups import GroupCache

NAMED = ["gpipe", "1f1b", "interleaved", "zb"]


@pytest.mark.parametrize("name", NAMED)
@pytest.mark.parametrize("world_size", [2, 4])
def test_named_plans_validate_and_round_trip(name: str, world_size: int) -> None:
    graph = captured("gpt-tiny")
    plan = resolve(name, graph, world_size)
    validate(plan, graph, world_size=world_size)
    pipe = plan.pipeline
    assert pipe is not None and pipe.kind == name
    assert len(pipe.groups) == world_size
    assert pipe.stages == world_size * (2 if name == "interleaved" else 1)
    assert pipe.micro_batches == 2 * world_size
    assert Plan.from_json(plan.to_json()) == plan
    # op-assign of whole stages: every piece on its stage's group
    for node, devices in plan.assignment.items():
        group = pipe.groups[pipe.stage_rank[pipe.stage_of[node]]]
        assert set(devices) <= set(group), node


def test_overrides_in_the_name() -> None:
    graph = captured("gpt-tiny")
    plan = resolve("1f1b:micro=4,tp=2,dp=2,zero=1", graph, 8)
    assert plan.pipeline.micro_batches == 4 and plan.pipeline.groups == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert str(plan.mesh) and plan.zero == 1 and plan.zero_axis == "dp"
    with pytest.raises(TorchweaveError, match="micro is a whole number"):
        resolve("1f1b:micro=four", graph, 2)


@pytest.mark.parametrize("name", NAMED)
def test_action_lists_of_every_named_plan(name: str) -> None:
    """Every F of a micro-batch precedes its backward on its rank; no deadlock; 1F1B's memory."""
    graph = captured("gpt-tiny")
    pipe = resolve(name, graph, 4).pipeline
    stage_to_rank = dict(enumerate(pipe.stage_rank))
    for rank, actions in pipe.schedule.items():
        at = {(a.kind, a.stage, a.micro): i for i, a in enumerate(actions)}
        for (kind, s, m), i in at.items():
            if kind in (Kind.B, Kind.I):
                assert at[(Kind.F, s, m)] < i, (rank, s, m)
            if kind is Kind.W:
                assert at[(Kind.I, s, m)] < i
    dry_run(add_communication(pipe.schedule, stage_to_rank), stage_to_rank, pipe.stages,
            pipe.micro_batches)
    if name in ("1f1b", "zb"):
        assert all(n <= 4 - (r if name == "1f1b" else 0) for r, n in peak_in_flight(pipe.schedule).items())


def test_stage_counts_that_do_not_fit_show_the_arithmetic() -> None:
    graph = captured("gpt-tiny")
    with pytest.raises(TorchweaveError, match=r"pp\(3\) \* dp\(1\) \* tp\(1\) = 3 != world_size\(4\)"):
        pipeline(graph, 4, pp=3)
    with pytest.raises(TorchweaveError, match=r"stages\(6\) != ranks\(4\) \* virtual\(1\)"):
        pipeline(graph, 4, stages=6)
    with pytest.raises(TorchweaveError, match=r"micro\(6\) % ranks\(4\) != 0"):
        pipeline(graph, 4, schedule="interleaved", micro=6)


def test_deadlocking_user_schedule_is_rejected_with_the_grid() -> None:
    graph = captured("gpt-tiny")
    plan = resolve("1f1b:micro=2", graph, 2)
    # rank 0 runs micro-batch 1's backward before its forward
    csv = "0,0F0,0B0,0B1,0F1\n1,1F0,1B0,1F1,1B1\n"
    with_schedule(plan, csv)
    with pytest.raises(ScheduleError) as err:
        validate(plan, graph)
    text = str(err.value)
    assert "F of stage 0 micro-batch 1 precedes its backward" in text
    assert "rank 0 |" in text  # the grid
    # a well-formed order that still deadlocks: rank 0 waits for 1B0, which waits for 0F1
    with_schedule(plan, {0: [Action(0, Kind.F, 0), Action(0, Kind.B, 0), Action(0, Kind.F, 1),
                             Action(0, Kind.B, 1)],
                         1: [Action(1, Kind.F, 0), Action(1, Kind.F, 1), Action(1, Kind.B, 0),
                             Action(1, Kind.B, 1)]})
    with pytest.raises(ScheduleError, match=r"deadlocks(.|\n)*\[0RECV_B0\](.|\n)*\[1RECV_F1\]"):
        validate(plan, graph)


def test_missing_backward_is_rejected_before_launch() -> None:
    graph = captured("gpt-tiny")
    plan = resolve("gpipe:micro=2", graph, 2)
    sched = dict(plan.pipeline.schedule)
    sched[1] = [a for a in sched[1] if a != Action(1, Kind.B, 1)]
    with_schedule(plan, to_csv(sched))
    with pytest.raises(ScheduleError, match="stage 1 micro-batch 1: no backward"):
        validate(plan, graph)


def test_bad_stage_placement_names_node_and_group() -> None:
    graph = captured("gpt-tiny")
    plan = resolve("1f1b", graph, 2)
    last = graph.nodes[-1].name
    plan.pipeline.stage_of[last] = 0  # the loss reads stage 1, and its piece is on group 1
    with pytest.raises(PlanError) as err:
        validate(plan, graph)
    text = str(err.value)
    assert f"node {last}" in text and "a stage reads only from itself and earlier stages" in text
    assert "a node's pieces run on its stage's group" in text


def test_segments_pass_values_between_stages_on_one_rank() -> None:
    """Interleaved stages cut mid-block: stage 2 reads stage 0's output on the same rank,
    through a boundary whose transfer is a message to itself (its gradient comes back the same way)."""
    graph = captured("gpt-tiny")
    names = [n.name for n in graph.nodes]
    plan = pipeline(graph, 2, schedule="interleaved", micro=2,
                    cuts=[names.index("layer_norm"), names.index("add_1"), names.index("layer_norm_2")])
    progs = lower(graph, plan)
    seg0, seg2 = progs[0].segments
    to_self = next(b for b in seg2.recvs if b.local.startswith("dropout_p2p"))
    assert [(t.src, t.dst) for t in to_self.step.transfers] == [(0, 0)]
    assert to_self.key in [b.key for b in seg0.sends]  # sent by stage 0, to rank 0 itself
    assert any(b.local == "dropout_1_p2p3" for b in seg2.recvs)  # from stage 1 on rank 1
    src = render(progs[0])
    assert "def stage0(rt, p, idx, targets, b):" in src and "def stage2(" in src
    assert f"{to_self.key} = b['{to_self.key}']" in src


def test_recompute_groups_keep_less_and_compute_the_same(tmp_path) -> None:
    model, inputs = built("gpt-tiny")[:2]
    graph = captured("gpt-tiny")
    state = {k: v.detach() for k, v in state_of(model).items()}
    group_cache = GroupCache(rank=0, world_size=1, timeout_s=5.0, device=torch.device("cpu"))
    results = []
    for k, groups in enumerate([(), ("mlp", "attn")]):
        plan = with_recompute(resolve("dp", graph, 1), graph, groups)
        (path,) = write(lower(graph, plan), str(tmp_path / str(k)))
        module = RankModule(lower(graph, plan)[0], path, state, group_cache)
        saved = saved_bytes(module, inputs)
        loss = module.backward_step(*inputs)
        results.append((saved, loss, {p: t.grad.clone() for p, t in module.params.items()
                                      if t.grad is not None}))
    (full, loss0, g0), (kept, loss1, g1) = results
    assert kept < 0.6 * full, (kept, full)
    assert loss0 == loss1
    for p in g0:
        torch.testing.assert_close(g1[p], g0[p], rtol=1e-6, atol=1e-8)
    assert "torch.utils.checkpoint.checkpoint(_rc" in (tmp_path / "1" / "rank0.py").read_text()


def test_user_op_order_constraints_reorder_a_schedule() -> None:
    graph = captured("gpt-tiny")
    plan = resolve("1f1b:micro=4", graph, 2)
    a = Action.parse
    with_schedule(plan, plan.pipeline.schedule, orders=[(a("0F3"), a("0B0")), (a("1F3"), a("1B0"))])
    validate(plan, graph)
    for rank, actions in plan.pipeline.schedule.items():
        assert actions.index(a(f"{rank}F3")) < actions.index(a(f"{rank}B0"))
    with pytest.raises(ScheduleError, match="form no cycle"):
        with_schedule(plan, plan.pipeline.schedule, orders=[(a("0B0"), a("0F0"))])
    with pytest.raises(ScheduleError, match="relates actions on one rank"):
        with_schedule(plan, plan.pipeline.schedule, orders=[(a("0F0"), a("1F0"))])


def test_interlaced_encoder_decoder_runs_its_decoder_embedding_with_the_others() -> None:
    """T5's decoder embedding sits between its two stacks in graph order but reads only the
    target tokens and the shared vocabulary: it runs in the first shared stage, on every
    device, so the shared weight never crosses stage groups (tests/dist/test_pipeline.py
    runs the plan against one device)."""
    from torchweave.plan.stage_plan import ALL

    graph = captured("t5-tiny")
    plan = resolve("interlaced", graph, 2)
    validate(plan, graph)
    pipe = plan.pipeline
    assert pipe.stage_rank[0] == ALL
    shared = [n.name for n in graph.nodes if n.module == "shared"]
    assert len(shared) >= 2 and all(pipe.stage_of[n] in (0, len(pipe.stage_rank) - 1) for n in shared)
    assert all(sorted(plan.assignment[n]) == [0, 1] for n in shared)
    lower(graph, plan)  # before: "p_shared_weight: AllGather across stage groups"


def test_interlaced_plan_shares_embedding_and_head_across_all_devices() -> None:
    from torchweave.plan.interlaced import check_shared
    from torchweave.plan.stage_plan import ALL

    graph = captured("gpt-tiny")
    plan = resolve("interlaced", graph, 4)
    validate(plan, graph)
    assert Plan.from_json(plan.to_json()) == plan
    pipe = plan.pipeline
    assert pipe.stage_rank == [ALL, 0, 1, 2, 3, ALL] and pipe.shared == [0, 5]
    # the embedding and the LM head are split over all four devices; each block op on one
    assert sorted(plan.assignment["embedding"]) == [0, 1, 2, 3]
    assert len(set(plan.assignment["linear_12"])) == 4  # the LM head, vocabulary-parallel
    assert all(len(plan.assignment[n]) == 1 for n, s in pipe.stage_of.items() if 0 < s < 5)
    shared = {r: [a for a in acts if a.stage in (0, 5)] for r, acts in pipe.schedule.items()}
    assert all(row == shared[0] for row in shared.values())  # one order on every rank
    progs = lower(graph, plan)
    assert [s.stage for s in progs[2].segments] == [0, 3, 5]
    # a rank joining the head of micro-batch 0 before its own forward of it deadlocks
    sched = {r: list(acts) for r, acts in pipe.schedule.items()}
    row = sched[3]
    head = [row.pop(row.index(Action(5, Kind.F, 0))), row.pop(row.index(Action(5, Kind.B, 0)))]
    row[pipe.micro_batches:pipe.micro_batches] = head
    with pytest.raises(ScheduleError, match=r"stage 4 feeds stage 5"):
        check_shared(sched, pipe.stage_rank, pipe.micro_batches)
    sched[3] = list(pipe.schedule[3])
    for r in range(3):  # ranks 0-2 join the head of micro-batch 0 before their blocks run it
        row = sched[r]
        head = [row.pop(row.index(Action(5, Kind.F, 0))), row.pop(row.index(Action(5, Kind.B, 0)))]
        row[pipe.micro_batches:pipe.micro_batches] = head
    with pytest.raises(ScheduleError, match=r"deadlocks(.|\n)*\[5F0\](.|\n)*\[4RECV_F0\]"):
        check_shared(sched, pipe.stage_rank, pipe.micro_batches)


def test_one_stage_pipeline_runs_in_process_and_matches_the_model(tmp_path) -> None:
    """The executor on one device (no process group): micro-batches, F then B, the mean loss."""
    from torchweave.runtime.executor import StepConfig
    from torchweave.runtime.schedule_runner import PipelineModule

    model, inputs = built("gpt-tiny")[:2]
    graph = captured("gpt-tiny")  # batch 4: micro-batches of 2
    plan = pipeline(graph, 1, schedule="gpipe", micro=2)
    programs = lower(graph, plan)
    (path,) = write(programs, str(tmp_path))
    state = {k: v.detach() for k, v in state_of(model).items()}
    group_cache = GroupCache(rank=0, world_size=1, timeout_s=5.0, device=torch.device("cpu"))
    with pytest.raises(TorchweaveError, match="takes its micro-batches from the plan"):
        PipelineModule(programs[0], path, state, group_cache, config=StepConfig(grad_accum=2))
    module = PipelineModule(programs[0], path, state, group_cache)
    big = tuple(torch.cat([x, x]) for x in inputs)  # each micro-batch is the example batch
    assert_grads_match_model(module, model, inputs, module.backward_step(*big))
    assert module.stats.peak_live == 2 and module.stats.wait_s == 0.0


def test_accumulation_with_a_pipeline_is_refused_before_any_code_is_written(tmp_path) -> None:
    """Found by bench/fuzz.py: the refusal came from every rank after launch."""
    from torchweave.parallel import compile_plan

    model, inputs = built("gpt-tiny")[:2]
    with pytest.raises(TorchweaveError, match=r"(?s)grad_accum.*takes its micro-batches from the plan"):
        compile_plan(model, inputs, "1f1b:micro=2", world_size=2, micro_batches=2,
                     code_dir=str(tmp_path / "code"))
    assert not (tmp_path / "code").exists()


def test_the_schedule_names_have_one_source() -> None:
    """Plan strings, the search's constraints and the fuzzer read the built-in kinds from one tuple."""
    import typing

    from torchweave.fuzz.draw import SCHEDULE_NAMES as drawn
    from torchweave.plan.schedules import BUILTIN
    from torchweave.policies.pipeline_policy import SCHEDULES, ScheduleName
    from torchweave.search.constraints import SCHEDULE_NAMES

    assert SCHEDULES is BUILTIN and drawn is BUILTIN and typing.get_args(ScheduleName) == BUILTIN
    assert SCHEDULE_NAMES == ("none", *BUILTIN, "interlaced")


def test_a_read_of_dtype_alone_moves_no_tensor_between_stages() -> None:
    """T5's norm ends in ``type_as(x)``, which reads only ``x``'s dtype. At a stage boundary
    ``x`` used to cross whole a second time (and its gradient back) for that read; now the
    norm's own read of ``x`` brings the only copy, and each value crosses once."""
    from torchweave.policies.spec import PlanSpec

    graph = captured("t5-tiny")
    plan = PlanSpec.parse("1f1b:tp=2,split=sequence").build(graph, 4)
    meta_only = {(n.name, r.name) for n in graph.nodes
                 for r, spec in zip(n.input_refs(), info(graph, n).bound.annotation.inputs)
                 if spec.meta_only}
    assert any(node.startswith("type_as") for node, _ in meta_only)  # the case is there
    for prog in lower(graph, plan):
        values = [b.step for s in prog.segments for b in s.recvs]
        crossed = [c.value for c in prog.comms() if c.dst in {b.key for s in prog.segments for b in s.recvs}]
        assert len(crossed) == len(set(crossed)) == len(values), (prog.rank, crossed)
        assert not any((c.consumer, c.value) in meta_only for c in prog.comms()), prog.rank


def test_each_stage_that_reads_a_tied_weight_keeps_a_copy() -> None:
    """gpt-tiny's ``wte`` is read by the embedding (stage 0) and the LM head (stage 1). It
    used to live on stage 0 alone and cross to stage 1 with every micro-batch (its gradient
    back with each). Each stage now keeps a copy of the piece it reads, as Megatron-LM keeps
    the word embedding on its last stage: no step moves it, and one gradient group per
    piece spans both stages' holders, summed once a step by the bucketed sync."""
    from torchweave.policies.spec import PlanSpec

    graph = captured("gpt-tiny")
    plan = PlanSpec.parse("1f1b:tp=2").build(graph, 4)  # stages on [0, 1] and [2, 3]
    for prog in lower(graph, plan):
        assert not [c for c in prog.comms() if c.value == "p_wte_weight"], prog.rank
        (slot,) = [s for s in prog.params if s.path == "wte.weight"]
        assert slot.grad_groups == ((prog.rank % 2, prog.rank % 2 + 2),)
        assert slot.replicas == 2  # the gradient norm counts the piece once
        assert slot.box[0] == ((0, 128) if prog.rank % 2 == 0 else (128, 256))
