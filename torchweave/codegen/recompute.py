"""Recompute groups in generated code: a nested function run under checkpoint.

A plan's recompute group is a set of nodes. Each maximal run of consecutive
instructions that feed nodes of one group (their compute and the
communication before it) becomes a nested function ``_rc{k}``, called through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: its inputs
are kept, its intermediate tensors are dropped after forward and recomputed
in backward (collectives in the run run again, on every member of their
group, in the same order). Parameters first read inside the run are read
just before it and passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Iterator, Union

from torchweave.codegen.safe import comment
from torchweave.lower.program import Comm, Compute, Free, Instr, Program
from torchweave.lower.stages import reads, writes


@dataclass
class RecomputeRun:
    group: Hashable
    """A recompute group's index, or ("co-shard", region, piece)."""
    items: list[tuple[int, Instr]]
    later: set[str]
    """Names read after the run."""

    def render(self, prog: Program, first_use: dict[int, list], keep: set[str],
               line: Callable[[Program, Instr], str]) -> list[str]:
        body = [ins for _, ins in self.items if not isinstance(ins, Free)]
        freed = {n for _, ins in self.items if isinstance(ins, Free) for n in ins.names}
        written = {n for ins in body for n in writes(ins)}
        inputs: list[str] = []
        for ins in body:
            for n in reads(ins):
                if n not in written and n not in inputs:
                    inputs.append(n)
        outputs = [n for ins in body for n in writes(ins) if n in self.later or n in keep]
        name = f"_rc{self.items[0][0]}"
        label = (f"co-shard region {self.group[1]} piece {self.group[2]}" if isinstance(self.group, tuple)
                 else f"recompute group {self.group}")
        nodes = sorted({ins.node if isinstance(ins, Compute) else ins.consumer for ins in body
                        if isinstance(ins, (Compute, Comm))})
        lines = []
        for i, _ in self.items:
            for prm in first_use.get(i, []):
                box = ", ".join(f"{a}:{b}" for a, b in prm.box)
                lines.append(f"    {prm.local} = p[{prm.path!r}]  # [{box}] of {tuple(prm.full_shape)}")
        shown = ", ".join(nodes[:6]) + (" …" if len(nodes) > 6 else "")
        lines.append(f"    def {name}({', '.join(inputs)}):  # {label}: {comment(shown)}")
        lines += ["    " + line(prog, ins) for ins in body]
        tup = ", ".join(outputs) + ("," if len(outputs) == 1 else "")
        lines.append(f"        return ({tup})")
        lhs = tup or "_"
        args = "".join(n + ", " for n in inputs)
        lines.append(f"    {lhs} = torch.utils.checkpoint.checkpoint({name}, {args}use_reentrant=False)")
        dead = sorted(n for n in freed if n in inputs and n not in keep)
        if dead:
            lines.append(f"    del {', '.join(dead)}")
        return lines


def _group_of(prog: Program) -> dict[str, int]:
    return {n: k for k, group in enumerate(prog.recompute) for n in group}


def recompute_runs(prog: Program, instrs: list[Instr]
                   ) -> Iterator[Union[tuple[int, Instr], RecomputeRun]]:
    """Each instruction as ``(index, instr)``, with recompute runs gathered into one item."""
    group_of = _group_of(prog)
    run: RecomputeRun | None = None
    pending: list[tuple[int, Instr]] = []

    def key(ins: Instr) -> Hashable | None:
        if isinstance(ins, Compute):
            if ins.chunk is not None:
                return ("co-shard", *ins.chunk)
            return group_of.get(ins.node)
        if isinstance(ins, Comm):
            return group_of.get(ins.consumer)
        return None

    def later(end: int) -> set[str]:
        return {n for ins in instrs[end:] for n in reads(ins)}

    for i, ins in enumerate(instrs):
        if isinstance(ins, Free) and run is not None:
            pending.append((i, ins))
            continue
        k = key(ins)
        if run is not None and k == run.group:
            run.items += pending + [(i, ins)]
            pending = []
            continue
        if run is not None:
            run.later = later(run.items[-1][0] + 1)
            run.items += pending  # frees right after the run: of its inputs or its own names
            yield run
            run, pending = None, []
        if k is not None:
            run = RecomputeRun(k, [(i, ins)], set())
        else:
            yield i, ins
    if run is not None:
        run.later = later(run.items[-1][0] + 1)
        run.items += pending
        yield run
