"""``parallelize``: a model, its example inputs and a plan → this rank's trainable piece."""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import gc
import json
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from torchweave.api import capture
from torchweave.codegen.render import write
from torchweave.errors import ModelReleased, Problem, TorchweaveError
from torchweave.graphfile import DTYPES, graph_from_json, graph_to_json
from torchweave.ir.graph import Graph, param_tensor
from torchweave.lower.lower import lower
from torchweave.lower.program import Comm, Program
from torchweave.lower.steps import P2P
from torchweave.plan.plan import Plan
from torchweave.plan.validate import validate
from torchweave.policies import PlanLike, resolve
from torchweave.policies.spec import merged_accum, micro_of, needs_search
from torchweave.runtime.executor import (
    OptimizerFactory, RankModule, StepConfig, default_optimizer,
)
from torchweave.runtime.broadcast import as_bytes, broadcast_tensor, broadcast_text
from torchweave.runtime.groups import GroupCache
from torchweave.runtime.schedule_runner import PipelineModule
from torchweave.runtime.statedict import StateLayout, state_layout


@dataclass
class Compiled:
    """Everything built before launch: checked once, shared by every rank."""

    graph: Graph
    plan: Plan
    programs: list[Program]
    code_paths: list[str]
    state: dict[str, torch.Tensor]
    layout: StateLayout | None = None
    """The model's state_dict names and where each piece lives (for ``pm.state_dict()``)."""
    example_shapes: tuple[tuple[int, ...] | None, ...] | None = None
    """The shape of each example input (``pm(*batch)`` checks the batch against it)."""

    def zero_group(self, rank: int) -> tuple[int, ...] | None:
        if not self.plan.zero:
            return None
        mesh = self.plan.mesh
        assert mesh is not None and self.plan.zero_axis is not None
        return next(g for g in mesh.groups(self.plan.zero_axis) if rank in g)


def model_state(model: torch.nn.Module, graph: Graph) -> dict[str, torch.Tensor]:
    """Parameters, buffers and lifted constants by module path, detached, on CPU."""
    state = {k: v.detach().cpu() for k, v in model.state_dict(keep_vars=True).items()}
    for k, v in model.named_buffers(remove_duplicate=False):
        state.setdefault(k, v.detach().cpu())
    for k, v in graph.meta.get("constants", {}).items():
        state[k] = v.detach().cpu()
    for v in graph.params():  # a fused projection's parts: views of the module's tensor
        if v.part is not None and v.part[0] in state:  # (a missing one: the executor says so)
            state[v.target] = param_tensor(state, v)
    return state


def _capture(model: torch.nn.Module, example_inputs: tuple[Any, ...], micro_batches: int,
             precision: str, graphs: dict | None = None) -> Graph:
    """The graph of one micro-batch; ``graphs`` caches it per (model, input shapes, micro, precision)."""
    key = (id(model), micro_batches, precision, tuple(
        (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in example_inputs))
    if graphs is not None and key in graphs:
        return graphs[key]
    graph = _capture_once(model, example_inputs, micro_batches, precision)
    if graphs is not None:
        graphs[key] = graph
    return graph


def _capture_once(model: torch.nn.Module, example_inputs: tuple[Any, ...], micro_batches: int,
                  precision: str) -> Graph:
    if micro_batches > 1:
        bad = [i for i, x in enumerate(example_inputs)
               if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] % micro_batches)]
        if bad:
            raise TorchweaveError(Problem(
                obj=f"example input {bad[0]}", value=str(tuple(example_inputs[bad[0]].shape)),
                rule=f"the batch divides into {micro_batches} micro-batches: "
                     f"{example_inputs[bad[0]].shape[0] if example_inputs[bad[0]].dim() else 0} "
                     f"% {micro_batches} != 0",
                fix="use a batch that is a multiple of the micro-batch count",
            ))
        example_inputs = tuple(x.chunk(micro_batches)[0] if isinstance(x, torch.Tensor) else x
                               for x in example_inputs)
    target, inputs = model, example_inputs
    if precision == "bf16":
        target = _meta_copy(model, torch.bfloat16)
        inputs = tuple(x.to(device="meta", dtype=torch.bfloat16 if x.is_floating_point() else x.dtype)
                       if isinstance(x, torch.Tensor) else x for x in example_inputs)
    return capture(target, inputs)


def _meta_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` on the meta device with floating tensors in ``dtype``, tied weights still tied.

    (``module.to("meta")`` makes a new parameter per module, so a tied pair would
    become two parameters, each trained on half its gradient.)
    """
    def meta(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(t, device="meta", dtype=dtype if t.is_floating_point() else t.dtype)
        return torch.nn.Parameter(out, t.requires_grad) if isinstance(t, torch.nn.Parameter) else out

    tensors = [t for _, t in (*model.named_parameters(remove_duplicate=False),
                              *model.named_buffers(remove_duplicate=False))]
    # deepcopy takes each tensor's copy from the memo: no data is copied, and a tensor
    # shared by two modules maps to one meta tensor
    return copy.deepcopy(model, {id(t): meta(t) for t in tensors})


def capture_and_resolve(model: torch.nn.Module, example_inputs: tuple[Any, ...], plan: PlanLike, *,
                        world_size: int, micro_batches: int = 1, precision: str = "fp32",
                        graphs: dict | None = None) -> tuple[Graph, Plan]:
    """The graph lowering reads (one micro-batch's, for a pipeline or accumulation) and the plan
    as resolved on it (see :func:`compile_plan`)."""
    k = merged_accum(plan, micro_batches)  # the plan's accum, or the step's grad_accum
    m = micro_of(plan, world_size) if k == 1 and not needs_search(plan) else None
    if m is not None and m > 1 and all(
            not isinstance(x, torch.Tensor) or (x.dim() > 0 and x.shape[0] % m == 0)
            for x in example_inputs):
        # a pipeline string: its micro-batch count is known, so one capture of one
        # micro-batch does (what the general path below ends with, after two)
        graph = _capture(model, example_inputs, m, precision, graphs)
        resolved = resolve(plan, graph, world_size)
        if resolved.pipeline is not None and resolved.pipeline.micro_batches == m:
            return graph, resolved
    graph = _capture(model, example_inputs, k, precision, graphs)
    if needs_search(plan):  # searched (or solved) once, on the whole batch
        from torchweave.search import resolve as resolve_auto  # only a search needs it

        resolved = resolve_auto(plan, graph, world_size)
        plan = resolved.notes["spec"]
    else:
        resolved = resolve(plan, graph, world_size)
    if resolved.accum != k and resolved.accum > 1:  # a policy function that set accum
        k = merged_accum(resolved, micro_batches)
        graph = _capture(model, example_inputs, k, precision, graphs)
        resolved = resolve(plan, graph, world_size)
    elif resolved.accum != k:  # what runs is written down: plan.json says accum
        resolved = dataclasses.replace(resolved, accum=k)
    pipe = resolved.pipeline
    if pipe is not None and k > 1:
        raise TorchweaveError(Problem(
            obj="StepConfig.grad_accum", value=str(k),
            rule=f"a pipelined plan ({resolved.name!r}) takes its micro-batches from the plan",
            fix=f"set grad_accum=1 (the plan runs {pipe.micro_batches} micro-batches), or raise "
                "the plan's micro (e.g. '1f1b:micro=8')"))
    if pipe is not None and pipe.micro_batches > 1 and k == 1:
        # a pipeline's forward sees one micro-batch: capture that shape, plan again on it
        graph = _capture(model, example_inputs, pipe.micro_batches, precision, graphs)
        if not isinstance(plan, Plan) and needs_search(plan):
            from torchweave.search import resolve as resolve_auto  # a solved split keeps the

            resolved = resolve_auto(plan, graph, world_size, like=resolved)  # whole batch's answer
        elif not isinstance(plan, Plan):
            resolved = resolve(plan, graph, world_size)
    return graph, resolved


def compile_plan(model: torch.nn.Module, example_inputs: tuple[Any, ...], plan: PlanLike, *,
                 world_size: int, code_dir: str | None = None, micro_batches: int = 1,
                 precision: str = "fp32", only_rank: int | None = None,
                 graphs: dict | None = None, front: tuple[Graph, Plan] | None = None) -> Compiled:
    """Capture, resolve and validate the plan, lower it and write each rank's code.

    With ``micro_batches`` > 1 the graph is captured on one micro-batch (the
    first 1/k of each input's dim 0), the shape every forward then sees. With
    ``precision="bf16"`` it is captured on a bf16 copy on the meta device, so the
    model's own casts (norms in fp32, say) are kept as written. ``graphs``: a
    cache of captures shared by several plans of the same models (graphs are
    read, never changed, by planning and lowering). ``front``: the graph and the
    resolved plan, already made (:func:`shared_front`); nothing is captured then.
    """
    graph, resolved = front or capture_and_resolve(model, example_inputs, plan, world_size=world_size,
                                                   micro_batches=micro_batches, precision=precision,
                                                   graphs=graphs)
    validate(resolved, graph, world_size=world_size)
    programs = lower(graph, resolved)
    _check_zero3_order(resolved, programs)
    code_dir = code_dir or _scratch_dir()
    if only_rank is None:
        paths = write(programs, code_dir)
    else:  # under torchrun every rank compiles; each writes only its own file
        paths = [""] * len(programs)
        paths[only_rank] = write([programs[only_rank]], code_dir)[0]
    if only_rank in (None, 0):
        with open(os.path.join(code_dir, "plan.json"), "w") as f:
            f.write(resolved.to_json())
    state = model_state(model, graph)
    shapes = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in example_inputs)
    return Compiled(graph, resolved, programs, paths, state, state_layout(model, programs, state),
                    shapes)


def shared_front(model: torch.nn.Module, example_inputs: tuple[Any, ...], plan: PlanLike, *,
                 groups: GroupCache, micro_batches: int = 1,
                 precision: str = "fp32") -> tuple[Graph, Plan] | None:
    """Capture and resolve on rank 0 alone; every rank then gets the graph and the plan as data.

    Capture (``torch.export``, and its import) and a searched plan cost seconds, and
    every rank of a job would pay them at once, on shared cores when ranks share a
    machine. Rank 0 does it, then broadcasts the graph in the graph-file format, the
    plan as plan JSON and the lifted constants as tensors: nothing is pickled, and
    both texts pass the loaders' checks (:func:`~torchweave.graphfile.graph_from_json`,
    :meth:`Plan.from_json`). Rank 0 goes on with what it sent, so every rank lowers
    the very same graph and plan.

    Where rank 0 could not write its graph or plan in their formats, it keeps its
    own and the others get None (each captures and resolves for itself). An error
    on rank 0 reaches every rank.
    """
    if groups.world_size == 1 or not dist.is_initialized() or \
            dist.get_world_size() != groups.world_size:
        return None
    if groups.rank == 0:
        try:
            graph, resolved = capture_and_resolve(model, example_inputs, plan,
                                                  world_size=groups.world_size,
                                                  micro_batches=micro_batches, precision=precision)
        except Exception as exc:
            broadcast_text(groups, json.dumps({"error": type(exc).__name__, "text": str(exc)[:2000]}))
            raise
        consts = graph.meta.get("constants", {})
        try:
            text = graph_to_json(graph)
            mine = graph_from_json(text)  # what the other ranks will read: refused, not sent
            plan_text = resolved.to_json()
            Plan.from_json(plan_text)
            bad = [k for k, v in consts.items() if v.dtype not in DTYPES.values()]
            if bad:
                raise ValueError(f"constant {bad[0]} of dtype {consts[bad[0]].dtype}")
            data = {k: as_bytes(v) for k, v in consts.items()}  # before the header: a failure
            # here falls back with every rank told, never between two broadcasts
        except Exception as exc:  # noqa: BLE001 - any graph the format cannot hold
            broadcast_text(groups, json.dumps({"each": f"{type(exc).__name__}: {exc}"[:300]}))
            return graph, resolved  # the others capture and resolve for themselves, as rank 0 did
        header = {"graph": text, "plan": plan_text,
                  "constants": [[k, str(v.dtype).removeprefix("torch."), list(v.shape)]
                                for k, v in consts.items()]}
        broadcast_text(groups, json.dumps(header))
    else:
        # while rank 0 captures: what the step needs anyway, so that its import overlaps
        # rank 0's work (every torch optimizer's constructor imports torch._dynamo, ~1.5 s)
        import torch._dynamo  # noqa: F401
        header = json.loads(broadcast_text(groups, None))
        if "error" in header:
            said = " / ".join(line.strip() for line in str(header.get("text", "")).splitlines())
            raise TorchweaveError(Problem(
                obj="rank 0's capture and plan", value=str(header["error"])[:100],
                rule=f"rank 0 captures the model and resolves the plan for every rank; it "
                     f"stopped with: {said}",
                fix="the fix rank 0's error names (every rank builds what rank 0 builds)"))
        if "each" in header:
            return None
    graph = mine if groups.rank == 0 else graph_from_json(header["graph"])
    resolved = Plan.from_json(header["plan"])
    graph.meta["constants"] = {}
    for k, dtype, shape in header["constants"]:
        here = data[k] if groups.rank == 0 else None
        graph.meta["constants"][k] = broadcast_tensor(groups, here, tuple(int(n) for n in shape),
                                                      DTYPES[dtype])
    return graph, resolved


def _scratch_dir() -> str:
    """A temporary folder for generated code that nobody asked to keep, removed when this
    process exits (a launch's spawned ranks and torchrun's exit normally: atexit runs)."""
    path = tempfile.mkdtemp(prefix="torchweave-code-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _check_zero3_order(plan: Plan, programs: list[Program]) -> None:
    """ZeRO-3 gathers each parameter unit when the rank first reads it. With point-to-point
    transfers (irregular layouts, a permuted device order), ranks of one ZeRO group may
    reach a gather and a transfer in different orders and wait on each other forever
    (found by bench/fuzz.py at 8 ranks)."""
    if plan.zero != 3:
        return
    p2p = [f"rank {prog.rank}: {ins.value}" for prog in programs for ins in prog.instrs
           if isinstance(ins, Comm) and isinstance(ins.step, P2P)]
    if p2p:
        raise TorchweaveError(Problem(
            obj=f"plan {plan.name!r}", value=f"zero=3 with {len(p2p)} point-to-point transfers "
                                             f"({', '.join(p2p[:3])}{', ...' if len(p2p) > 3 else ''})",
            rule="ZeRO-3 gathers parameters as each rank first reads them, which point-to-point "
                 "transfers between differently ordered ranks can deadlock",
            fix="use zero=1 or zero=2, or a plan whose layouts need no point-to-point transfers "
                "(no permuted device order)"))


def rank_module(compiled: Compiled, group_cache: GroupCache, *, optimizer: OptimizerFactory,
                config: StepConfig) -> RankModule:
    rank = group_cache.rank
    cls = PipelineModule if compiled.plan.pipeline is not None else RankModule
    if cls is RankModule:  # the plan's accum, merged with the step's by compile_plan
        config = dataclasses.replace(config, grad_accum=compiled.plan.accum)
    module = cls(compiled.programs[rank], compiled.code_paths[rank], compiled.state, group_cache,
                 optimizer=optimizer, config=config, zero=compiled.plan.zero,
                 zero_group=compiled.zero_group(rank))
    module.layout, module.example_shapes = compiled.layout, compiled.example_shapes
    return module


def parallelize(
    model: torch.nn.Module, example_inputs: tuple[Any, ...], *, plan: PlanLike,
    groups: GroupCache | None = None, optimizer: OptimizerFactory = default_optimizer,
    config: StepConfig = StepConfig(), code_dir: str | None = None, share_capture: bool = True,
) -> RankModule:
    """This rank's share of ``model`` under ``plan``.

    Train it in your own loop (``loss = pm(*batch); loss.backward()`` with
    :func:`torchweave.optimizer`; pipelined plans: ``loss = pm.step(*batch)``),
    or with ``pm.train_step(*batch)``, which also steps ``optimizer``.

    Call it on every rank of an initialized process group (under
    :func:`torchweave.spawn` or torchrun). Rank 0 captures the model and resolves
    the plan, and sends both to every rank (:func:`shared_front`); each rank
    lowers them and runs its own generated code, written under ``code_dir``.
    ``share_capture=False``: every rank captures for itself, for a model whose
    forward leaves Python state that every rank reads afterwards (capture is the
    only time the model's own forward runs; the Lightning strategy's wrapper
    learns there which logged value is the loss).

    ``model`` is held weakly: each rank keeps its own pieces, and the model's memory goes
    when the caller drops it. A batch of shapes other than the example's is compiled from
    the model (:class:`ModelReleased` once it is gone), so keep a reference to it while
    batches change shape; a model in a reference cycle goes only at the collector's next
    full pass, which Python times.
    """
    if groups is None:
        if not dist.is_initialized():
            raise TorchweaveError(Problem(
                obj="parallelize", value="no process group",
                rule="parallelize runs on every rank of an initialized process group",
                fix="call it inside torchweave.spawn(fn, LaunchConfig(world_size=...)) or under torchrun",
            ))
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")
        groups = GroupCache(rank=dist.get_rank(), world_size=dist.get_world_size(),
                            timeout_s=60.0, device=device)
    with startup_collector():
        front = shared_front(model, example_inputs, plan, groups=groups,
                             micro_batches=config.grad_accum, precision=config.precision) \
            if share_capture else None
        compiled = compile_plan(model, example_inputs, plan, world_size=groups.world_size,
                                code_dir=code_dir, micro_batches=config.grad_accum,
                                precision=config.precision, only_rank=groups.rank, front=front)
        module = rank_module(compiled, groups, optimizer=optimizer, config=config)
    module.recompile = _recompiler(model, compiled, groups, config, code_dir)
    return module


@contextlib.contextmanager
def startup_collector() -> Iterator[None]:
    """Keep the cycle collector off the objects alive when a rank starts building its piece.

    After ``import torch`` a process holds some 330,000 long-lived objects, and capture
    allocates enough new ones to trigger full collections, each walking them all: for
    ``dp`` on bench/parallel.py's GPT, three during capture and lowering, 0.34 CPU-s on
    rank 0, on the path every other rank waits on. Inside this block those objects are
    frozen (:func:`gc.freeze`), so collections walk only what startup makes; on leaving it
    they go back to the collector (:func:`gc.unfreeze`), so nothing is kept from it for
    good (a user's model in a reference cycle is still freed once deleted). A process
    that froze objects itself is left as it is.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _recompiler(model: torch.nn.Module, compiled: Compiled, groups: GroupCache, config: StepConfig,
                code_dir: str | None):
    """This rank's program and code for a batch of other shapes, under the plan as resolved
    for the example batch (no new search): a new capture, checked and lowered again.

    It holds the model weakly and keeps only the plan of ``compiled``: a rank keeps its own
    pieces, and the whole model's parameters, the graph and its constants go when the
    caller lets the model go (PyTorch's pipeline stages keep only their own blocks too)."""
    rank, done, plan, held = groups.rank, [0], compiled.plan, weakref.ref(model)
    example = compiled.example_shapes

    def compile_for(batch: tuple[Any, ...]) -> tuple[Program, str]:
        model = held()
        if model is None:
            shapes = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in batch)
            raise ModelReleased(Problem(
                obj="pm(*batch)", value=f"input shapes {shapes}",
                rule="a batch of shapes other than the example's is compiled from the model given "
                     "to parallelize, and that model has been released (torchweave keeps no "
                     "reference to it, so that its memory goes when yours does)",
                fix=f"keep a reference to the model while training on batches of other shapes, or "
                    f"pad batches to the example's shapes {example}"))
        done[0] += 1
        sub = os.path.join(code_dir, f"shape{done[0]}") if code_dir else None
        again = compile_plan(model, batch, plan, world_size=groups.world_size, code_dir=sub,
                             micro_batches=config.grad_accum, precision=config.precision,
                             only_rank=rank)
        return again.programs[rank], again.code_paths[rank]

    return compile_for
