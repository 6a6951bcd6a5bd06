"""Check annotations against the ops themselves, on real tensors.

For a call and every legal split into 2 and 4 parts, run each piece, combine
the outputs as the annotation says, and compare with the whole op. A wrong
annotation (a softmax axis marked spatial, a contraction marked spatial) gives
pieces that do not add up, and is reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.utils._pytree as pytree

from torchweave.ir.graph import Graph, Node, TensorMeta, param_tensor
from torchweave.ir.interp import on_device, run_node, substitute
from torchweave.ops.bind import Bound, Split, bind
from torchweave.ops.pieces import _close, combine, piece_call
from torchweave.ops.registry import REGISTRY, Call, OpSpec, Registry


@dataclass(frozen=True)
class Failure:
    """One split whose pieces do not give the whole op's result."""

    target: str
    annotation: str
    split: Split
    reason: str

    def __str__(self) -> str:
        return f"{self.target} '{self.annotation}' split {self.split}: {self.reason}"


@dataclass(frozen=True)
class Case:
    """An op call on concrete tensors."""

    target: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    where: str = ""


def _metas(tree: Any) -> Any:
    return pytree.tree_map(lambda t: TensorMeta.of(t) if isinstance(t, torch.Tensor) else t, tree)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def bind_case(case: Case, registry: Registry = REGISTRY, spec: OpSpec | None = None
              ) -> tuple[OpSpec, Bound, list[torch.Tensor]]:
    spec = spec or registry.lookup(case.target)
    if spec is None:
        raise KeyError(f"{case.target} is not registered")
    out = case.fn(*case.args, **case.kwargs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    call = Call(case.target, _metas(case.args), _metas(case.kwargs),
                [TensorMeta.of(t) for t in _tensors((case.args, case.kwargs))],
                [TensorMeta.of(t) for t in outs])
    return spec, bind(spec.annotate(call), call.inputs, call.outputs, op=case.target), outs


def check_case(case: Case, parts: tuple[int, ...] = (2, 4), registry: Registry = REGISTRY,
               spec: OpSpec | None = None) -> list[Failure]:
    """Every legal split of ``case`` into ``parts`` pieces gives the whole result."""
    spec, bound, full = bind_case(case, registry, spec)
    failures = []
    for split in bound.splits():
        if split.parts not in parts:
            continue
        reason = check_split(spec, case, bound, split, full)
        if reason:
            failures.append(Failure(case.target, str(bound), split, reason))
    return failures


def check_split(spec: OpSpec, case: Case, bound: Bound, split: Split,
                full: list[torch.Tensor]) -> str | None:
    pieces = []
    for index in range(split.parts):
        fn, args, kwargs = piece_call(spec, case.fn, case.args, case.kwargs, bound, split, index)
        try:
            out = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a piece that cannot run is a failure
            return f"piece {index} raised {type(exc).__name__}: {str(exc).splitlines()[0]}"
        pieces.append(list(out) if isinstance(out, (tuple, list)) else [out])
    if spec.random:
        ok = all(p.shape == f.shape for p, f in zip(combine(bound, split, pieces, spec.partial, full), full) if p is not None)
        return None if ok else "pieces have the wrong shapes"
    joined = combine(bound, split, pieces, spec.partial, full)
    for j, (got, want) in enumerate(zip(joined, full)):
        if got is None:
            return f"output {j}: pieces differ, but it is not split or partial"
        if not _close(got, want):
            err = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else "shape"
            return f"output {j}: combined pieces differ from the whole op (max abs err {err})"
    return None


def graph_cases(graph: Graph, state: Mapping[str, torch.Tensor],
                inputs: tuple[torch.Tensor, ...], name: str = "",
                device: torch.device | None = None) -> Iterator[Case]:
    """Replay ``graph`` and yield each node's call on the tensors it really sees.

    ``device``: the device ``state`` and ``inputs`` are on (lifted constants move
    there, ops that make tensors make them there); None: as captured."""
    env: dict[str, torch.Tensor] = {}
    consts = graph.meta.get("constants", {})
    for v in graph.values.values():
        if v.kind in ("param", "buffer"):
            t = param_tensor(state, v) if v.target in state or v.part else consts[v.target]
            env[v.name] = t if device is None else t.to(device)
    env.update(zip(graph.inputs, inputs))
    with torch.no_grad():
        for node in graph.nodes:
            args = on_device(substitute(node.args, env), device)
            kwargs = on_device(substitute(node.kwargs, env), device)
            yield Case(node.target, node.op, args, kwargs, f"{name} {node.name} {node.source}")
            run_node(node, env, device)


def dedupe(cases: Iterator[Case]) -> list[Case]:
    """One case per (op, argument shapes and constants)."""
    seen: dict[str, Case] = {}
    for c in cases:
        key = f"{c.target} {_metas(c.args)} {_metas(c.kwargs)}"
        seen.setdefault(key, c)
    return list(seen.values())


def node_case(node: Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Case:
    return Case(node.target, node.op, args, kwargs, node.source)
