"""Per-rank programs: the instructions a plan becomes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Union

import torch.utils._pytree as pytree

from torchweave.lower.steps import P2P, Box, Group, Step
from torchweave.plan.schedules import Action


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
    chunk: tuple[int, int] | None = None
    """Co-shard: (region, piece) — the pieces of a region run one after another."""
    aux: bool = False
    """A step lowering adds around the node's own call (a view of a slice, a sum or a join
    of pieces, a rescale): not the node's work, so the simulator does not cost it as such."""

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_reads"}

    def reads(self) -> list[str]:
        """Local names this call reads (computed once: the call is immutable)."""
        hit = self.__dict__.get("_reads")
        if hit is None:
            out: list[str] = []
            _refs((self.args, self.kwargs), out)
            hit = tuple(out)
            object.__setattr__(self, "_reads", hit)
        return list(hit)


def _refs(x: Any, out: list[str]) -> None:
    """The names of the LocalRefs in ``x``, in ``pytree.tree_leaves`` order: plain tuples,
    lists and dicts walked here (a step's calls are mostly these), anything else by pytree."""
    t = type(x)
    if t is LocalRef:
        out.append(x.name)
    elif t is tuple or t is list:
        for y in x:
            _refs(y, out)
    elif t is dict:
        for y in x.values():
            _refs(y, out)
    elif not (x is None or t in _ATOMS):
        out.extend(y.name for y in pytree.tree_leaves(x) if isinstance(y, LocalRef))


_ATOMS = frozenset({int, float, bool, str, complex})


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
    extra: tuple[str, ...] = ()
    """Local names the step reads besides ``src``, passed by the keywords its step names
    (:attr:`torchweave.lower.steps.Route.EXTRA`): a routed exchange reads its route."""

    def reads(self) -> list[str]:
        """Local names this step reads."""
        return [self.src, *self.extra]


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
    part: tuple[str, int, int] | None = None
    """For a parameter that is a slice of a module tensor (:attr:`Value.part
    <torchweave.ir.graph.Value.part>`): ``(module path, dim, start)``; ``path`` then names the
    slice, and ``box`` is within it."""
    copied: bool = False
    """A copy kept on each pipeline rank that reads it (a tied embedding and LM head:
    ``lower/copies.py``): its gradient group spans stage groups, so its sum waits
    for the schedule's end (``runtime/schedule_runner.py``)."""


@dataclass(frozen=True)
class InputSlot:
    local: str
    index: int
    """Position in the user's inputs (positional args then kwargs, in order)."""
    name: str


@dataclass(frozen=True)
class Boundary:
    """A value crossing from a stage on one device group to a stage on another.

    The same on every rank it touches; the runtime sends and receives its
    transfers (and their gradients back) as the schedule reaches them.
    """

    key: str
    """The name the receivers bind; the same on every rank."""
    index: int
    """Position among all boundaries of the plan (message tags derive from it)."""
    step: P2P
    local: str
    """On a sender, the tensor it sends from; on a receiver, the name it binds."""
    grad: bool
    """Floating point: the gradient flows back along ``step.grad_back``."""
    dtype: str = "torch.float32"


@dataclass(frozen=True)
class RecycleLink:
    """Multi-forward: a value of the last stage carried back as stage 0's input for the next pass.

    The same on every rank it touches. Receivers hold the input whole (as
    every input), zero outside the region ``boxes`` gives them, which is the
    part their ops read.
    """

    input: str
    """The input's local name."""
    index: int
    """Its position in the user's inputs."""
    output: str
    """On a sender, the local tensor it sends from."""
    step: P2P
    """Transfers from the holders of the output to each receiver's region (no gradient)."""
    boxes: tuple[tuple[int, Box], ...]
    """Receiver → the region of the whole input it receives."""


@dataclass(frozen=True)
class Message:
    """One point-to-point message of a pipelined step: the same value on both ranks."""

    link: int
    """The boundary's index; recycle links follow the boundaries."""
    micro: int
    grad: bool
    """The gradient of a boundary, going back (else its value, going forward)."""
    transfer: int
    """Which transfer of the link (its position in ``transfers`` or ``grad_back``)."""
    iteration: int
    """The forward pass it belongs to (gradients: the last)."""
    src: int
    dst: int

    def __str__(self) -> str:
        what = "grad" if self.grad else "value"
        return (f"{what} of link {self.link} micro {self.micro} pass {self.iteration} "
                f"transfer {self.transfer} ({self.src}->{self.dst})")


@dataclass(frozen=True)
class Exchange:
    """The messages of one action of one rank."""

    posts: tuple[Message, ...]
    """Receives posted before the compute, in their senders' order (some for later actions)."""
    needs: tuple[Message, ...]
    """What the compute reads, in order: from other ranks (posted by now, here or earlier)
    and from this rank itself (kept from its ``local`` sends)."""
    sends: tuple[Message, ...]
    """Sends posted after the compute, in this order."""
    local: tuple[Message, ...] = ()
    """Pieces this rank sends to itself (kept in memory, never posted)."""


@dataclass
class Segment:
    """The part of one rank's forward that belongs to one pipeline stage."""

    stage: int
    instrs: list["Instr"]
    inputs: list[str] = field(default_factory=list)
    """Names from this rank's other segments (handed over in memory)."""
    outputs: list[str] = field(default_factory=list)
    """Names that this rank's later segments read, or that are sent."""
    recvs: list[Boundary] = field(default_factory=list)
    sends: list[Boundary] = field(default_factory=list)
    loss: str | None = None


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
    segments: list[Segment] = field(default_factory=list)
    """Pipelined plans: one segment per stage this rank runs, in stage order."""
    actions: list[Action] = field(default_factory=list)
    """Pipelined plans: this rank's compute actions (its group's schedule row)."""
    micro_batches: int = 1
    boundaries: int = 0
    """Pipelined plans: how many boundaries the whole plan has (message tags number them)."""
    passes: int = 1
    """Multi-forward: forward passes per micro-batch, the last with gradients."""
    recycle: list[RecycleLink] = field(default_factory=list)
    """Multi-forward: what comes back from the last stage to stage 0 between passes."""
    recompute: list[tuple[str, ...]] = field(default_factory=list)
    """Groups of nodes whose activations are recomputed in backward."""
    messages: list[Exchange] = field(default_factory=list)
    """Pipelined plans: per action, the messages it posts, reads and sends
    (:mod:`torchweave.lower.messages`; the executor issues exactly these)."""

    def comms(self) -> list[Comm]:
        return [i for i in self.instrs if isinstance(i, Comm)]

    def regathers(self) -> bool:
        """Whether a forward all-gather here keeps its shard for backward (``regather``)."""
        return any(getattr(c.step, "regather", False) for c in self.comms())

    def computes(self) -> list[Compute]:
        return [i for i in self.instrs if isinstance(i, Compute)]


def zero_owns(slot, group: tuple[int, ...]) -> bool:
    """Whether a ZeRO plan sharding over ``group`` (``Plan.zero_group``) owns ``slot``: its
    gradient is summed over that group. What it does not own (a tied weight's copies, summed
    across stage groups; a norm's under sequence parallelism, over tp × dp; under ep, all
    but the experts, over dp × ep) keeps its whole gradient and optimizer state (``runtime/zero.py``)."""
    return bool(group) and tuple(group) in (tuple(g) for g in slot.grad_groups)


def optimizer_numels(slots, group: tuple[int, ...]) -> list[int]:
    """The tensors a rank's optimizer steps, by element count: with ZeRO over ``group``, one
    flat shard of what it owns (``runtime/zero.py``), then each parameter it keeps whole;
    without, each trainable parameter piece (what ``torchweave calibrate``'s op profiles key
    the AdamW step by)."""
    trainable = [s for s in slots if s.requires_grad and not s.is_buffer]
    each = [math.prod(b - a for a, b in s.box) for s in trainable]
    if len(group) <= 1:
        return each
    owned = sum(n for n, s in zip(each, trainable) if zero_owns(s, group))
    return [owned // len(group)] + [n for n, s in zip(each, trainable) if not zero_owns(s, group)]
