"""``parallelize``: a model, its example inputs and a plan → this rank's trainable piece.

The graph and the resolved plan come from :mod:`torchweave.front` (rank 0 captures and
resolves, every rank receives them as data); here they are checked, lowered, written as
each rank's code and built into this rank's module."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from torchweave.codegen.render import write
from torchweave.errors import ModelReleased, Problem, TorchweaveError
from torchweave.front import capture_and_resolve, shared_front
from torchweave.ir.graph import Graph, param_tensor
from torchweave.lower.lower import lower
from torchweave.lower.program import Comm, Program
from torchweave.lower.steps import P2P
from torchweave.plan.plan import Plan
from torchweave.plan.validate import validate
from torchweave.policies import PlanLike
from torchweave.runtime.executor import (
    OptimizerFactory, RankModule, StepConfig, default_optimizer,
)
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
        assert self.plan.mesh is not None and self.plan.zero_axis is not None
        return self.plan.zero_group(rank)


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
