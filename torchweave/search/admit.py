"""Whether a built plan keeps the constraints' rules about ops, cuts, pins and ties.

The space (:mod:`torchweave.search.space`) covers degrees and schedules; these
rules are about what a plan does to particular ops, so they are checked on the
plan once it is built, and a plan that breaks one is left out with the rule in
words.
"""

from __future__ import annotations

import fnmatch

from torchweave.ir.graph import Graph
from torchweave.plan.plan import Plan
from torchweave.search.constraints import Constraints, OpRule
from torchweave.search.space import Point


def op_rules(plan: Plan, graph: Graph, rules: tuple[OpRule, ...], tp: int, dp: int = 1
              ) -> str | None:
    """The first op rule ``plan`` breaks, in words (None: it keeps them all). Rules are
    about an op's partition inside one data-parallel replica: the batch split that data
    parallelism makes of every op (its first transform, ``dp`` parts) is not theirs."""
    for rule in rules:
        for node in graph.nodes:
            if node.name not in plan.trans or not rule.selects(node):
                continue
            trans = list(plan.transforms(node.name))
            if dp > 1 and trans and trans[0].parts == dp:
                trans = trans[1:]
            splits = [t for t in trans if t.dim is not None and t.parts > 1]
            if rule.replicate is False and not splits:
                return f"{rule} says {node.name} ({node.module}) is split, but tp={tp} keeps it whole"
            for t in splits:
                if rule.parts is not None and t.parts not in rule.parts:
                    return (f"tp={tp} splits {node.name} ({node.module}) into {t.parts}, but "
                            f"{rule} allows {list(rule.parts)}")
                if rule.split is not None and t.dim not in rule.split and str(t.dim) not in map(
                        str, rule.split):
                    return (f"tp={tp} splits {node.name} ({node.module}) on dim {t.dim}, but "
                            f"{rule} allows dims {list(rule.split)}")
            if rule.replicate is True and splits and rule.parts is None and rule.split is None:
                return f"{rule} keeps {node.name} ({node.module}) whole, but tp={tp} splits it"
    return None


def admissible(plan: Plan, graph: Graph, c: Constraints, pt: Point) -> str | None:
    """The first constraint ``plan`` breaks (op rules, cuts, pins, ties), or None."""
    bad = op_rules(plan, graph, c.ops, pt.tp, pt.dp)
    if bad:
        return bad
    pipe = plan.pipeline
    if pipe is not None and (c.cuts is not None or c.pin):
        first: dict[int, object] = {}
        for node in graph.nodes:
            s = pipe.stage_of.get(node.name)
            if s is not None and s not in first:
                first[s] = node
        if c.cuts is not None:
            for s, node in sorted(first.items()):
                if s and not c.allows_cut(node.module or ""):
                    return (f"stage {s} starts at {node.module or node.name}, not at a cut the "
                            f"constraints allow ({', '.join(c.cuts)})")
        last = pipe.stages - 1
        for glob, want in c.pin.items():
            stage = {"first": 0, "last": last}.get(want, want)
            for node in graph.nodes:
                if fnmatch.fnmatchcase(node.module or "", glob) and pipe.stage_of.get(
                        node.name, stage) != stage:
                    return (f"{node.module} is pinned to stage {want}, but the plan runs it on "
                            f"stage {pipe.stage_of[node.name]}")
    for group in c.ties:
        for names in tied(graph, group):
            sigs = [(n, tuple((t.dim, t.parts) for t in plan.transforms(n))) for n in names]
            for n, sig in sigs[1:]:
                if sig != sigs[0][1]:
                    return (f"ties {list(group)}: {sigs[0][0]} is split {sigs[0][1]} but {n} "
                            f"{sig}")
    return None


def tied(graph, group: tuple[str, ...]) -> list[list[str]]:
    """The node names a tie makes share one partition: the modules the globs select are
    lined up op by op (a module's i-th op with every other's i-th op of the same type), so
    ``[q_proj, k_proj]`` ties their matrix products together and their bias additions
    together, not a product to an addition."""
    by_module: dict[str, list] = {}
    for node in graph.nodes:
        if any(fnmatch.fnmatchcase(node.module or "", g) for g in group):
            by_module.setdefault(node.module or "", []).append(node)
    columns: dict[tuple[int, str], list[str]] = {}
    for nodes in by_module.values():
        for i, node in enumerate(nodes):
            columns.setdefault((i, node.target), []).append(node.name)
    return [names for names in columns.values() if len(names) > 1]


__all__ = ["admissible", "op_rules", "tied"]
