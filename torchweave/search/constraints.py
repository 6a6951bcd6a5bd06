"""Constraints on the plan search: what an expert (or a preset) allows, as data.

A constraint set says which degrees, schedules, recompute modes and ZeRO stages
the search may use, how much memory a device has, and rules on ops selected
by type, module-path glob or node name. It is written in Python
(:class:`Constraints`) or YAML (:func:`~torchweave.search.constraints_file.load_constraints`),
and a preset is one YAML file in ``torchweave/search/presets/``
(:func:`~torchweave.search.constraints_file.preset`):

.. code-block:: yaml

    preset: megatron          # start from a preset; the keys below override it
    tp: [1, 2, 4, 8]          # a list of allowed values,
    pp: {min: 1, max: 16}     # or a range (every divisor of the world inside it),
    dp: any                   # or any divisor of the world (ep too: experts split, MoE only)
    micro: {max: 64}          # micro-batches per step (pipelines)
    virtual: [1, 2, 3, 4]     # stages per pipeline rank (interleaved)
    schedules: [none, 1f1b, interleaved, zb]   # none: no pipeline
    recompute: [none, selective, full]
    coshard: [0, 4]           # the output head in K chunks (0: not co-sharded)
    tied: [copy, send]        # pipelines: a parameter read on several stages copied, or its
                              # lookups run where it is held (plan strings' tied=)
    balance: [flops, seconds] # pipeline cuts: whole blocks by FLOPs (the policy's), or at
                              # block and sub-block modules by each op's seconds (cuts=)
    zero: [0, 1]
    sp: true                  # tensor parallelism may shard the sequence between ops
    split: [rule, solved]     # ops split on tp by Megatron's rules, by the solver, or both
    memory_gib: 70            # per device (default: the device's memory)
    ops:                      # rules on ops, each selecting by type, module or name
      - {module: "blocks.*.attn.*", parts: [1, 2, 4, 8]}
      - {type: "aten.layer_norm.default", replicate: true}
    cuts: ["blocks.*"]        # pipeline stages may start only at these modules
    pin: {"lm_head": last}    # a module on a stage (first, last or an index)
    ties: [["blocks.*.attn.q_proj", "blocks.*.attn.k_proj"]]   # one partition

Files are data: :mod:`torchweave.search.constraints_file` reads YAML with the safe
composer, checks every key against the schema, and a mistake names its line, the key
and the keys allowed there.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace
from typing import Any

from torchweave.plan.schedules import BUILTIN
from torchweave.policies.spec import SPLITS

SCHEDULE_NAMES = ("none", *BUILTIN, "interlaced")
"""``none``: no pipeline (pp = 1); the others are the pipeline schedules (``interlaced``:
embeddings and head tensor-parallel over every device, the blocks pipelined one stage
per device; :func:`torchweave.policies.pipeline_policy.interlaced`)."""
RECOMPUTE = ("none", "selective", "full")
BALANCE = ("flops", "seconds")
"""How pipeline stages are cut (:attr:`Constraints.balance`)."""
COSHARD = ("0", "2", "4", "8", "16")
"""Co-shard of the output head: 0 (none) or the chunks each device runs it in
(:mod:`torchweave.policies.coshard`)."""


@dataclass(frozen=True)
class Degrees:
    """Allowed values of one degree: ``only`` (a list) or ``lo``–``hi`` (None: no bound),
    optionally powers of two only."""

    only: tuple[int, ...] | None = None
    lo: int = 1
    hi: int | None = None
    powers_of_two: bool = False

    def allows(self, n: int) -> bool:
        if self.only is not None:
            return n in self.only
        if n < self.lo or (self.hi is not None and n > self.hi):
            return False
        return not self.powers_of_two or n & (n - 1) == 0

    def __str__(self) -> str:
        if self.only is not None:
            return "[" + ", ".join(map(str, self.only)) + "]"
        text = f"{self.lo}..{self.hi if self.hi is not None else 'any'}"
        return text + (" (powers of two)" if self.powers_of_two else "")


ANY = Degrees()


@dataclass(frozen=True)
class OpRule:
    """Ops selected by ``type`` (an aten target), ``module`` (a glob over module paths) or
    ``name`` (a node name); what a plan may do with them."""

    type: str | None = None
    module: str | None = None
    name: str | None = None
    split: tuple[int | str, ...] | None = None
    """Dims the ops may be split on (None: any)."""
    parts: tuple[int, ...] | None = None
    """How many parts a split may have (None: any)."""
    replicate: bool | None = None
    """False: the ops must be split; True: they may stay whole (None: as the rest allow)."""
    line: int | None = None

    def selects(self, node) -> bool:
        if self.type is not None and node.target != self.type:
            return False
        if self.module is not None and not fnmatch.fnmatchcase(node.module or "", self.module):
            return False
        return self.name is None or node.name == self.name

    def __str__(self) -> str:
        sel = ", ".join(f"{k}={v!r}" for k, v in (("type", self.type), ("module", self.module),
                                                   ("name", self.name)) if v is not None)
        return f"ops rule ({sel})" + (f" at line {self.line}" if self.line else "")


@dataclass(frozen=True)
class Constraints:
    """The space the search may look in (see the module docstring)."""

    tp: Degrees = ANY
    pp: Degrees = ANY
    dp: Degrees = ANY
    ep: Degrees = ANY
    micro: Degrees = Degrees(hi=64)
    virtual: Degrees = Degrees(only=(1, 2, 3, 4))
    schedules: tuple[str, ...] = SCHEDULE_NAMES
    recompute: tuple[str, ...] = RECOMPUTE
    coshard: tuple[int, ...] = (0,)
    """The output head (LM head and loss) in K chunks per device (0: whole)."""
    zero: tuple[int, ...] = (0, 1, 2, 3)
    balance: tuple[str, ...] = ("flops",)
    """How pipeline stages are cut: ``flops`` (the pipeline policy's cut between whole blocks,
    by FLOPs) and/or ``seconds`` (the search's cut at block and sub-block module boundaries
    that ``cuts`` allows, by each op's roofline seconds on the cluster, written into the plan
    string as ``cuts=``; offered for encoder-decoders, whose pipelines the simulator runs
    exactly anyway: :mod:`torchweave.search.cuts`). ``[seconds]`` alone puts each seconds
    cut in place of the whole-block one; where none is offered (the same cut, or not an
    encoder-decoder) the point keeps the policy's cut."""
    tied: tuple[str, ...] = ("copy",)
    """How pipelines hold a parameter that several stages read (``tied=`` in plan strings):
    ``copy`` (a copy a stage, summed once a step) and/or ``send`` (its lookups run on its
    stage: :func:`~torchweave.policies.stage_cuts.send_lookups`)."""
    sp: bool = True
    split: tuple[str, ...] = SPLITS
    memory_gib: float | None = None
    ops: tuple[OpRule, ...] = ()
    cuts: tuple[str, ...] | None = None
    """Module globs a pipeline stage may start at (None: any block boundary)."""
    pin: dict[str, str | int] = field(default_factory=dict)
    ties: tuple[tuple[str, ...], ...] = ()
    name: str = "custom"
    description: str = ""

    def with_(self, **changes: Any) -> Constraints:
        return replace(self, **changes)

    def allows_cut(self, module: str) -> bool:
        """Whether a pipeline stage may start at ``module`` (or inside it): ``cuts`` unset,
        or one of its globs matches the module or a module above it."""
        return self.cuts is None or any(
            fnmatch.fnmatchcase(module, g) or fnmatch.fnmatchcase(module + ".x", g + ".*")
            for g in self.cuts)


__all__ = ["ANY", "BALANCE", "COSHARD", "Constraints", "Degrees", "OpRule", "RECOMPUTE",
           "SCHEDULE_NAMES", "SPLITS"]
