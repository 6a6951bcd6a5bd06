"""Per-rank programs: the instructions a plan becomes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from torchweave.lower.steps import Box, Group, Step


@dataclass(frozen=True)
class LocalRef:
    """A tensor local to one rank's program."""

    name: str

    def __repr__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Compute:
    """Run one piece of a node."""

    node: str
    fn: str
    """Import path of the callable: ``aten.linear.default`` or a module path."""
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[str, ...]
    structure: str
    comment: str = ""


@dataclass(frozen=True)
class Comm:
    """One communication step on this rank."""

    step: Step
    value: str
    src: str
    dst: str
    comment: str = ""
    consumer: str = ""
    """The node this communication feeds."""


@dataclass(frozen=True)
class Free:
    names: tuple[str, ...]


Instr = Union[Compute, Comm, Free]


@dataclass(frozen=True)
class ParamSlot:
    """A parameter (or buffer) piece held by this rank."""

    local: str
    path: str
    box: Box
    full_shape: tuple[int, ...]
    requires_grad: bool
    is_buffer: bool = False
    grad_groups: tuple[Group, ...] = ()
    """Groups over which this piece's gradient is summed after backward."""
    replicas: int = 1
    """How many ranks hold this same piece (for global norms)."""


@dataclass(frozen=True)
class InputSlot:
    local: str
    index: int
    """Position in the user's inputs (positional args then kwargs, in order)."""
    name: str


@dataclass
class Program:
    """What one rank runs for one training step's forward."""

    rank: int
    world_size: int
    plan_name: str
    groups: list[Group]
    """Every group any rank uses, in one global order (for process group creation)."""
    params: list[ParamSlot] = field(default_factory=list)
    inputs: list[InputSlot] = field(default_factory=list)
    instrs: list[Instr] = field(default_factory=list)
    loss: str | None = None
    loss_partial: tuple[int, int] = (0, 1)
    loss_group: Group | None = None
    """Ranks whose loss terms add up to the loss (for logging)."""
    mesh: str = ""

    def comms(self) -> list[Comm]:
        return [i for i in self.instrs if isinstance(i, Comm)]

    def computes(self) -> list[Compute]:
        return [i for i in self.instrs if isinstance(i, Compute)]
