"""``parallelize``: a model, its example inputs and a plan → this rank's trainable piece."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchweave.api import capture
from torchweave.codegen.render import write
from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph
from torchweave.lower.lower import lower
from torchweave.lower.program import Program
from torchweave.plan.plan import Plan
from torchweave.plan.validate import validate
from torchweave.policies import PlanLike, resolve
from torchweave.runtime.executor import (
    OptimizerFactory, RankModule, StepConfig, default_optimizer,
)
from torchweave.runtime.groups import GroupCache


@dataclass
class Compiled:
    """Everything built before launch: checked once, shared by every rank."""

    graph: Graph
    plan: Plan
    programs: list[Program]
    code_paths: list[str]
    state: dict[str, torch.Tensor]

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
    return state


def compile_plan(model: torch.nn.Module, example_inputs: tuple[Any, ...], plan: PlanLike, *,
                 world_size: int, code_dir: str | None = None) -> Compiled:
    """Capture, resolve and validate the plan, lower it and write each rank's code."""
    graph = capture(model, example_inputs)
    resolved = resolve(plan, graph, world_size)
    validate(resolved, graph, world_size=world_size)
    programs = lower(graph, resolved)
    code_dir = code_dir or tempfile.mkdtemp(prefix="torchweave-code-")
    paths = write(programs, code_dir)
    with open(os.path.join(code_dir, "plan.json"), "w") as f:
        f.write(resolved.to_json())
    return Compiled(graph, resolved, programs, paths, model_state(model, graph))


def rank_module(compiled: Compiled, gc: GroupCache, *, optimizer: OptimizerFactory,
                config: StepConfig) -> RankModule:
    rank = gc.rank
    return RankModule(compiled.programs[rank], compiled.code_paths[rank], compiled.state, gc,
                      optimizer=optimizer, config=config, zero=compiled.plan.zero,
                      zero_group=compiled.zero_group(rank))


def parallelize(
    model: torch.nn.Module, example_inputs: tuple[Any, ...], *, plan: PlanLike,
    groups: GroupCache | None = None, optimizer: OptimizerFactory = default_optimizer,
    config: StepConfig = StepConfig(), code_dir: str | None = None,
) -> RankModule:
    """This rank's share of ``model`` under ``plan``, with ``train_step(*batch)``.

    Call it on every rank of an initialized process group (under
    :func:`torchweave.launch` or torchrun). Every rank compiles the same plan;
    each runs its own generated code, written under ``code_dir``.
    """
    if groups is None:
        if not dist.is_initialized():
            raise TorchweaveError(Problem(
                obj="parallelize", value="no process group",
                rule="parallelize runs on every rank of an initialized process group",
                fix="call it inside torchweave.launch(fn, world_size) or under torchrun",
            ))
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")
        groups = GroupCache(rank=dist.get_rank(), world_size=dist.get_world_size(),
                            timeout_s=60.0, device=device)
    compiled = compile_plan(model, example_inputs, plan, world_size=groups.world_size,
                            code_dir=code_dir)
    return rank_module(compiled, groups, optimizer=optimizer, config=config)
