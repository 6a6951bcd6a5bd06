"""Where a pipeline's stages start and what each holds: the cut into stages (by FLOPs between
whole blocks, at graph positions, or at named modules: plan strings' ``cuts=``) and lookups of
a table an earlier stage holds, moved there (``tied=send``). The pipeline policies
(:mod:`torchweave.policies.pipeline_policy`) build on these."""

from __future__ import annotations

from collections import Counter

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph
from torchweave.ops import info
from torchweave.policies.recompute import block_of as _block


def send_lookups(graph: Graph, stage_of: dict[str, int]) -> dict[str, int]:
    """``stage_of`` with each lookup of an earlier stage's parameter moved to that stage.

    A lookup here is an op that reads parameters, all first read on one earlier stage,
    and a model input, and otherwise only buffers: an encoder-decoder's decoder
    embedding, which reads the target tokens and the vocabulary the encoder's stage 0
    holds. Run on stage 0, it sends its output (one micro-batch's embeddings) to the stage
    that reads it, in place of a copy of the whole table on that stage and the sum of the
    copies' gradients once a step. An op that also reads an activation (a tied output
    head) stays where it is, and so does a lookup that is its stage's only op.
    """
    first: dict[str, int] = {}
    for node in graph.nodes:
        for ref in node.input_refs():
            if graph.values[ref.name].kind == "param":
                first[ref.name] = min(first.get(ref.name, stage_of[node.name]), stage_of[node.name])
    out = dict(stage_of)
    count = Counter(stage_of.values())
    for node in graph.nodes:
        homes = {first[p] for p in _looked_up(graph, node)}
        here = out[node.name]
        if len(homes) == 1 and min(homes) < here and count[here] > 1:  # never empty a stage
            out[node.name] = min(homes)
            count[here] -= 1
    return out


def shared_lookups(graph: Graph) -> list[str]:
    """The ops :func:`send_lookups` moves under some cut: lookups of a parameter that an op
    before them reads too (elsewhere ``tied=send`` builds the same plan as ``copy``)."""
    seen: set[str] = set()
    out = []
    for node in graph.nodes:
        if _looked_up(graph, node) & seen:
            out.append(node.name)
        seen.update(r.name for r in node.input_refs() if graph.values[r.name].kind == "param")
    return out


def _looked_up(graph: Graph, node) -> set[str]:
    """The parameters ``node`` looks up: it reads them and a model input, and no
    activation (a transposed weight alone would send the table itself); else empty."""
    kinds = {r.name: graph.values[r.name].kind for r in node.input_refs()}
    if "activation" in kinds.values() or "input" not in kinds.values():
        return set()
    return {name for name, kind in kinds.items() if kind == "param"}


def module_starts(graph: Graph, depth: int | None = None) -> dict[str, int]:
    """Module path → the graph position of its first op (an op of it or of a module inside
    it), for every module with ops (``depth``: only paths of at most that many parts)."""
    first: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        if not node.module:
            continue  # an op the model's forward runs outside any submodule
        parts = node.module.split(".")
        for k in range(1, min(len(parts), depth or len(parts)) + 1):
            first.setdefault(".".join(parts[:k]), i)
    return first


def cut_positions(graph: Graph, modules: list[str], stages: int) -> list[int]:
    """The graph positions where stages 1, 2, … start: each module's first op (an op of
    the module or of one inside it), as plan strings name them (``cuts=encoder.5+decoder.2``)."""
    if len(modules) != stages - 1:
        raise TorchweaveError(Problem(
            obj="pipeline cuts", value="+".join(modules),
            rule=f"{stages} stages start at {stages - 1} modules, one for each stage after the "
                 f"first: got {len(modules)}",
            fix="name one module per stage after the first, in graph order"))
    first = module_starts(graph)
    out = []
    for name in modules:
        if name not in first or first[name] == 0:
            known = sorted({".".join((n.module or "").split(".")[:2]) for n in graph.nodes} - {""})
            raise TorchweaveError(Problem(
                obj="pipeline cuts", value=name,
                rule="a stage starts at a module of the model that has ops, and not at the first op"
                     if name in first else "a stage starts at a module of the model that has ops",
                fix=f"one of the model's modules, e.g. {', '.join(known[:6])}"))
        if out and first[name] <= out[-1]:
            raise TorchweaveError(Problem(
                obj="pipeline cuts", value="+".join(modules),
                rule=f"stages start in graph order: {name} starts at op {first[name]}, not after "
                     f"the stage before it (op {out[-1]})",
                fix="list the modules in the order the model runs them"))
        out.append(first[name])
    return out


def cut_modules(graph: Graph, positions: list[int]) -> list[str]:
    """The shortest module paths whose first op is each position (the inverse of
    :func:`cut_positions`), or an empty list where one has none."""
    first = module_starts(graph)
    at: dict[int, str] = {}
    for name, i in sorted(first.items(), key=lambda kv: (len(kv[0].split(".")), kv[0])):
        at.setdefault(i, name)
    return [at[p] for p in positions] if all(p in at for p in positions) else []


def cut_at(graph: Graph, cuts: list[int], stages: int) -> dict[str, int]:
    """Node → stage, stage ``j`` starting at graph position ``cuts[j - 1]``."""
    n = len(graph.nodes)
    if len(cuts) != stages - 1 or list(cuts) != sorted(set(cuts)) or not all(0 < c < n for c in cuts):
        raise TorchweaveError(Problem(
            obj="pipeline cuts", value=str(list(cuts)),
            rule=f"{stages} stages need {stages - 1} increasing cut positions in 1..{n - 1}: "
                 f"got {len(cuts)}",
            fix="one position per stage after the first, where that stage starts"))
    return {node.name: sum(1 for c in cuts if i >= c) for i, node in enumerate(graph.nodes)}


def cut(graph: Graph, stages: int, nodes: list | None = None) -> dict[str, int]:
    """Node → stage: graph order (or ``nodes``) cut into ``stages`` runs of about equal FLOPs.

    Cuts go where a numbered block starts or ends when there are enough such
    places, else anywhere. Each stage gets at least one node.
    """
    nodes = graph.nodes if nodes is None else nodes
    if stages > len(nodes):
        raise TorchweaveError(Problem(
            obj="pipeline stages", value=f"stages={stages}",
            rule=f"each stage holds at least one op: stages({stages}) > ops({len(nodes)})",
            fix="use fewer stages"))
    cost = [info(graph, n).flops + 1.0 for n in nodes]
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    keys = [_block(n.module) for n in nodes]
    places = [i for i in range(1, len(nodes)) if keys[i] != keys[i - 1]]
    if len(places) < stages - 1:
        places = list(range(1, len(nodes)))
    after = {q: len(places) - k - 1 for k, q in enumerate(places)}  # places after each
    cuts: list[int] = []
    for j in range(1, stages):
        target = prefix[-1] * j / stages
        lo = cuts[-1] if cuts else 0
        left = stages - 1 - j  # cuts still to place after this one
        options = [i for i in places if i > lo and after[i] >= left]
        cuts.append(min(options, key=lambda i: abs(prefix[i] - target)))
    out: dict[str, int] = {}
    stage = 0
    for i, n in enumerate(nodes):
        while stage < len(cuts) and i >= cuts[stage]:
            stage += 1
        out[n.name] = stage
    return out


__all__ = ["cut", "cut_at", "cut_modules", "cut_positions", "module_starts",
           "send_lookups", "shared_lookups"]
