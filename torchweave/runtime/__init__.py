"""Runtime: launching ranks, process groups, autograd-aware collectives."""

from torchweave.runtime.counter import CommCounter, CommKind, Direction
from torchweave.runtime.groups import GroupCache, GroupError
from torchweave.runtime.launch import (
    LaunchConfig, LaunchError, RankContext, RankFailedError, init_from_env, spawn,
)

__all__ = [
    "CommCounter", "CommKind", "Direction", "GroupCache", "GroupError", "LaunchConfig",
    "LaunchError", "RankContext", "RankFailedError", "init_from_env", "spawn",
]
