"""A training job from its config: pick the plan, then run it on every rank.

``torchweave train`` and ``torchweave demo`` call :func:`run` and print what it
returns; a script can call it too. Outside torchrun it starts ``world_size``
local processes (:func:`torchweave.runtime.launch.spawn`); under torchrun it is
one rank of the job, and only rank 0 gets the result.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from torchweave.ir.graph import Graph
from torchweave.runtime.launch import LaunchConfig, RankContext, init_from_env, spawn
from torchweave.train.auto import Choice
from torchweave.train.config import TrainConfig
from torchweave.train.loop import RunResult, Trainer


@dataclass
class Chosen:
    """The plan a job runs, and what it was chosen on."""

    plan: str
    reason: str
    """Why this plan (the search's reason for ``auto``; empty for a plan the config names)."""
    choice: Choice | None
    """The simulator's ranking for ``auto``; ``None`` otherwise."""
    graph: Graph
    """The model's graph on one micro-batch."""
    parameters: int
    samples: int
    """Samples in the dataset."""


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def choose(cfg: TrainConfig) -> Chosen:
    """The plan to run: the config's, or for ``auto`` the one the simulator predicts fastest
    among those that fit (captured on one micro-batch of the first batch)."""
    import torch

    from torchweave.api import capture
    from torchweave.train.auto import search_plan
    from torchweave.train.build import build_model
    from torchweave.train.config import is_auto
    from torchweave.train.data import Sampler, build_dataset

    torch.manual_seed(cfg.seed)
    dataset = build_dataset(cfg.data, cfg.seed)
    model = build_model(cfg.model, vocab_size=getattr(dataset, "vocab_size", None),
                        seq_len=cfg.data.seq_len)
    batch = Sampler(dataset, cfg.parallel.global_batch, cfg.seed).next_batch()
    k = cfg.parallel.grad_accum
    graph = capture(model, tuple(x.chunk(k)[0] for x in batch))
    plan, reason, choice = cfg.parallel.plan, "", None
    if is_auto(plan):
        choice = search_plan(graph, plan, cfg.parallel)
        plan, reason = choice.plan, f"auto: {choice.reason}"
    return Chosen(plan, reason, choice, graph, sum(p.numel() for p in model.parameters()),
                  len(dataset))


def launch_config(cfg: TrainConfig, timeout_s: float) -> LaunchConfig:
    return LaunchConfig(world_size=cfg.parallel.world_size, timeout_s=timeout_s,
                        threads_per_rank=cfg.threads_per_rank)


def rank_main(ctx: RankContext, cfg: TrainConfig, plan: str, reason: str) -> RunResult:
    """One rank's whole run of ``plan``."""
    return Trainer(cfg, ctx, plan=plan, plan_reason=reason).run()


def run_plan(cfg: TrainConfig, plan: str, reason: str = "", *, timeout_s: float = 300.0) -> RunResult:
    """Run ``plan`` on ``cfg.parallel.world_size`` local processes; rank 0's result."""
    return spawn(rank_main, launch_config(cfg, timeout_s), cfg, plan, reason)[0]


def run(cfg: TrainConfig, *, timeout_s: float = 300.0,
        on_chosen: Callable[[Chosen], None] | None = None) -> tuple[RunResult | None, Chosen]:
    """Choose the plan (``on_chosen`` sees it before launch, on rank 0 only) and run it here,
    or as one rank of torchrun's job. The result is rank 0's; other ranks get ``None``."""
    if under_torchrun():
        ctx = init_from_env(launch_config(cfg, timeout_s))
        chosen = choose(cfg)
        if on_chosen is not None and ctx.rank == 0:
            on_chosen(chosen)
        result = rank_main(ctx, cfg, chosen.plan, chosen.reason)
        ctx.close()
        return (result if ctx.rank == 0 else None), chosen
    chosen = choose(cfg)
    if on_chosen is not None:
        on_chosen(chosen)
    return run_plan(cfg, chosen.plan, chosen.reason, timeout_s=timeout_s), chosen


__all__ = ["Chosen", "choose", "launch_config", "rank_main", "run", "run_plan", "under_torchrun"]
