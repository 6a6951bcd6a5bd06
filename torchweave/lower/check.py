"""``check_program``: the contract lowering's Programs keep, checked on all ranks at once.

Codegen, the runtime and the simulator each trust these; a pass that breaks one is caught
here, at lowering, rather than as a name error in generated code or a rank that waits for a
message nobody sends:

- the ranks are 0..n-1, agree on the world size, and list the same groups in one order;
- every collective's groups are groups of that list, within the world, disjoint, and hold
  the rank that runs it;
- every local name is defined before it is read, and not read after it is freed; the loss
  is defined;
- a pipelined Program's segments hold each of its instructions exactly once, in stage order;
- every boundary is the same on each rank it touches, and each of its transfers is sent by
  its source rank and received by its destination rank.
"""

from __future__ import annotations

from torchweave.errors import Problem, TorchweaveError
from torchweave.lower.program import Boundary, Comm, Compute, Free, Program
from torchweave.lower.steps import P2P, Narrow


class ProgramError(TorchweaveError):
    """Lowering produced a Program that breaks its contract (a torchweave bug)."""


_FIX = "a bug in lowering: report it with the plan (torchweave plan --save) and the model"


def check_program(programs: list[Program], *, names: bool = True) -> None:
    """Raise :class:`ProgramError` naming every broken rule (see the module's docstring).

    ``names=False`` skips the def-before-use rules: a pipelined plan lowered without its
    stages (``lower(stages=False)``, read by the simulator only) keeps each boundary's
    transfer whole on every rank, receivers included, which never runs as code."""
    problems: list[Problem] = []

    def bad(obj: str, value: str, rule: str) -> None:
        problems.append(Problem(obj=obj, value=value, rule=rule, fix=_FIX))

    world = len(programs)
    for i, prog in enumerate(programs):
        if prog.rank != i or prog.world_size != world:
            bad(f"program {i}", f"rank {prog.rank} of {prog.world_size}",
                f"programs are ranks 0..{world - 1} of {world}, in order")
        if prog.groups != programs[0].groups:
            bad(f"rank {prog.rank}'s groups", str(prog.groups), "every rank lists rank 0's groups")
    known = {tuple(g) for g in programs[0].groups} if programs else set()
    crossing = {b.key for prog in programs for seg in prog.segments for b in seg.sends + seg.recvs}
    for prog in programs:
        _check_groups(prog, known, world, bad)
        if prog.segments:
            _check_segments(prog, crossing, bad)
        elif names:
            _check_names(prog, prog.instrs, set(), bad)
            if prog.loss is not None and prog.loss not in _defined(prog, prog.instrs):
                bad(f"rank {prog.rank}'s loss", prog.loss, "the loss is a name the program defines")
    _check_boundaries(programs, bad)
    if problems:
        raise ProgramError(problems[:20])


def _check_groups(prog: Program, known: set, world: int, bad) -> None:
    for c in prog.comms():
        if isinstance(c.step, (P2P, Narrow)):
            continue
        groups = [tuple(g) for g in c.step.groups]
        members = [r for g in groups for r in g]
        where = f"rank {prog.rank}'s {c.step.NAME} of {c.value}"
        if any(g not in known for g in groups):
            bad(where, str(groups), "its groups are among the program's groups")
        if len(set(members)) != len(members) or any(not 0 <= r < world for r in members):
            bad(where, str(groups), f"its groups are disjoint ranks in [0, {world})")
        if prog.rank not in members:
            bad(where, str(groups), "one of its groups holds the rank that runs it")


def _outside(prog: Program) -> set[str]:
    return {p.local for p in prog.params} | {i.local for i in prog.inputs}


def _defined(prog: Program, instrs: list) -> set[str]:
    """Every name ``instrs`` define (freed or not), with the rank's parameters and inputs."""
    out = _outside(prog)
    for ins in instrs:
        if isinstance(ins, Compute):
            out.update(o for o in ins.outputs if o)
        elif isinstance(ins, Comm):
            out.add(ins.dst)
    return out


def _check_names(prog: Program, instrs: list, given: set[str], bad, where: str = "") -> set[str]:
    """Reads of ``instrs`` against what is defined before them (``given`` too); returns the
    names live at the end."""
    defined = _outside(prog) | given
    freed: set[str] = set()

    def need(name: str, what: str) -> None:
        if name not in defined:
            rule = "is not read after it is freed" if name in freed else "is defined before use"
            bad(f"rank {prog.rank}{where}: {what}", name, f"every local name {rule}")

    for ins in instrs:
        if isinstance(ins, Compute):
            for name in ins.reads():
                need(name, f"{ins.node} ({ins.fn})")
            defined.update(o for o in ins.outputs if o)
        elif isinstance(ins, Comm):
            for name in ins.reads():
                need(name, f"{ins.step.NAME} of {ins.value}")
            defined.add(ins.dst)
        elif isinstance(ins, Free):
            for name in ins.names:
                need(name, "free")
            defined.difference_update(ins.names)
            freed.update(ins.names)
    return defined


def _check_segments(prog: Program, crossing: set[str], bad) -> None:
    """Each segment reads what it defines, receives or is handed by another of this rank's
    segments; the segments hold the program's instructions but those crossing stages."""
    want = [i for i in prog.instrs
            if not isinstance(i, Free) and not (isinstance(i, Comm) and i.dst in crossing)]
    got = [i for seg in prog.segments for i in seg.instrs if not isinstance(i, Free)]
    if sorted(map(id, want)) != sorted(map(id, got)):
        bad(f"rank {prog.rank}'s segments", f"{len(got)} instructions for {len(want)}",
            "the segments hold each instruction of the program once, but boundaries")
    stages = [seg.stage for seg in prog.segments]
    if stages != sorted(set(stages)):
        bad(f"rank {prog.rank}'s segments", str(stages), "one segment per stage, in stage order")
    handed = {name for seg in prog.segments for name in seg.outputs}
    for seg in prog.segments:
        where = f" stage {seg.stage}"
        for name in seg.inputs:
            if name not in handed:
                bad(f"rank {prog.rank}{where}'s inputs", name,
                    "a segment's inputs are outputs of this rank's other segments")
        live = _check_names(prog, seg.instrs, set(seg.inputs) | {b.local for b in seg.recvs},
                            bad, where)
        made = _defined(prog, seg.instrs) | set(seg.inputs) | {b.local for b in seg.recvs}
        for b in seg.sends:
            if b.local not in made:
                bad(f"rank {prog.rank}{where}'s send of {b.key}", b.local,
                    "a segment sends what it defines, receives or is handed")
        if seg.loss is not None and seg.loss not in live | made:
            bad(f"rank {prog.rank}{where}'s loss", seg.loss, "the loss is a name the stage defines")


def _check_boundaries(programs: list[Program], bad) -> None:
    seen: dict[str, Boundary] = {}
    sent: set[tuple[str, int, int]] = set()
    received: set[tuple[str, int, int]] = set()
    for prog in programs:
        for seg in prog.segments:
            for b, into in [(b, sent) for b in seg.sends] + [(b, received) for b in seg.recvs]:
                first = seen.setdefault(b.key, b)
                if (first.index, first.step, first.grad) != (b.index, b.step, b.grad):
                    bad(f"boundary {b.key}", f"rank {prog.rank}'s copy",
                        "a boundary is the same on every rank it touches")
                me = prog.rank
                into.update((b.key, t.src, t.dst) for t in b.step.transfers
                            if me == (t.src if into is sent else t.dst))
    for key, b in seen.items():
        for t in b.step.transfers:
            if (key, t.src, t.dst) not in sent:
                bad(f"boundary {key}", f"transfer {t.src}->{t.dst}", "its source rank sends it")
            if (key, t.src, t.dst) not in received:
                bad(f"boundary {key}", f"transfer {t.src}->{t.dst}",
                    "its destination rank receives it")


__all__ = ["ProgramError", "check_program"]
