"""The captured forward computation: tensors, nodes and the graph.

A :class:`Graph` is the forward pass once, as a flat list of :class:`Node` in
execution order. Every tensor is a named *value* with a :class:`TensorMeta`.
Node arguments keep the structure the op takes (lists, constants, dtypes) with
each tensor replaced by a :class:`Ref` to a value name, so a graph can be run
again, printed, or rendered as code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

import torch
import torch.utils._pytree as pytree


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return f"{dt}[{', '.join(map(str, self.shape))}]"

    @staticmethod
    def of(t: torch.Tensor) -> "TensorMeta":
        return TensorMeta(tuple(int(s) for s in t.shape), t.dtype)


@dataclass(frozen=True)
class Ref:
    """A reference to a named tensor value inside node arguments."""

    name: str

    def __repr__(self) -> str:
        return f"%{self.name}"


ValueKind = Literal["param", "buffer", "input", "activation"]


@dataclass
class Value:
    """A tensor in the graph: where it comes from and what it looks like."""

    name: str
    meta: TensorMeta
    kind: ValueKind
    target: str = ""
    """For params and buffers, the module path (``blocks.3.attn.qkv.weight``).
    For inputs, the argument name of ``forward``."""
    aliases: tuple[str, ...] = ()
    """Other module paths of the same tensor (tied weights)."""
    requires_grad: bool = False
    part: tuple[str, int, int] | None = None
    """``(module path, dim, start)``: this parameter is the slice ``[start, start + size)``
    along ``dim`` of the module tensor at that path, not a whole module tensor. Capture
    splits a fused projection so (:mod:`torchweave.capture.unfuse`); :func:`part_target`
    names it, and :func:`param_tensor` reads it from a module's state."""


def part_target(path: str, dim: int, start: int, stop: int) -> str:
    """The name of a parameter that is a slice of a module tensor: ``path[:, a:b]``."""
    return f"{path}[{':,' * dim}{start}:{stop}]"


def param_tensor(state: "Any", v: Value) -> torch.Tensor:
    """``v``'s tensor from a state keyed by module paths (a slice, for a part)."""
    if v.part is None:
        return state[v.target]
    path, dim, start = v.part
    return state[path].narrow(dim, start, v.meta.shape[dim])


def join_parts(graph: "Graph", tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A dict by graph target as one by module path: the parts of a module tensor (each
    :attr:`Value.part`) joined into it. A module tensor missing a part is left out."""
    groups: dict[str, list[Value]] = {}
    for v in graph.params():
        if v.part is not None:
            groups.setdefault(v.part[0], []).append(v)
    out = {k: t for k, t in tensors.items()
           if not any(k == v.target for vs in groups.values() for v in vs)}
    for path, vs in groups.items():
        vs.sort(key=lambda v: v.part[2])  # type: ignore[index]
        if all(v.target in tensors for v in vs):
            out[path] = torch.cat([tensors[v.target] for v in vs], dim=vs[0].part[1])  # type: ignore[index]
    return out


@dataclass
class Node:
    """One op call. ``args``/``kwargs`` hold :class:`Ref` in place of tensors."""

    name: str
    target: str
    """The op's qualified name, e.g. ``aten.linear.default``."""
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[str, ...]
    """Names of the tensor values this node produces, in output order."""
    source: str = ""
    """The user's source location, ``file.py:42``."""
    source_line: str = ""
    """That line of code, stripped."""
    module: str = ""
    """Module path of the innermost user module, ``blocks.3.attn``."""
    annotation: str | None = None
    """The bound dimension annotation, filled in by :mod:`torchweave.ops`."""
    output_structure: Literal["single", "tuple"] = "single"
    """Whether the op returns one tensor or a sequence of them."""

    def __getstate__(self) -> dict[str, Any]:
        return _without_caches(self.__dict__)

    def flat(self) -> tuple[tuple[Any, ...], Any]:
        """``(args, kwargs)`` flattened: the leaves and the tree spec that rebuilds them.

        Remembered while ``args`` and ``kwargs`` are the same objects (capture's rewrites
        assign new ones): plan builds, lowering and simulation ask for every node many
        times, and flattening was most of what they spent."""
        hit = self.__dict__.get("_flat")
        if hit is not None and hit[0] is self.args and hit[1] is self.kwargs:
            return hit[2], hit[3]
        leaves, spec = pytree.tree_flatten((self.args, self.kwargs))
        self.__dict__["_flat"] = (self.args, self.kwargs, tuple(leaves), spec)
        return tuple(leaves), spec

    def input_refs(self) -> list[Ref]:
        """Tensor inputs in flattened argument order (the annotation's order)."""
        return [leaf for leaf in self.flat()[0] if isinstance(leaf, Ref)]

    @property
    def op(self) -> Any:
        """The callable this node runs."""
        return resolve_target(self.target)


def _without_caches(state: dict[str, Any]) -> dict[str, Any]:
    """An object's state for pickling and copying, less what it remembers (``_``-named:
    derived from the rest, and not always picklable, e.g. an op rule's local function)."""
    return {k: v for k, v in state.items() if not k.startswith("_")}


def resolve_target(target: str) -> Any:
    """``aten.linear.default`` → ``torch.ops.aten.linear.default``."""
    ns, _, rest = target.partition(".")
    obj: Any = getattr(torch.ops, ns)
    for part in rest.split("."):
        obj = getattr(obj, part)
    return obj


NO_GRAD = frozenset(f"aten.{op}.default" for op in (
    "new_zeros", "new_ones", "new_empty", "new_full", "zeros_like", "ones_like", "empty_like",
    "full_like", "rand_like", "randn_like", "randint_like", "detach"))
"""Ops whose output takes no gradient from their tensor inputs (those only give a shape,
dtype or device, or are detached on purpose)."""


@dataclass
class Graph:
    """A captured forward pass."""

    nodes: list[Node]
    values: dict[str, Value]
    inputs: list[str]
    """User input values in ``forward`` argument order."""
    outputs: list[str]
    """Output values in flattened order."""
    loss: str | None = None
    """The value that is the scalar loss, when the model returns one."""
    model_name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __getstate__(self) -> dict[str, Any]:
        return _without_caches(self.__dict__)

    def params(self) -> list[Value]:
        return [v for v in self.values.values() if v.kind == "param"]

    def buffers(self) -> list[Value]:
        return [v for v in self.values.values() if v.kind == "buffer"]

    def num_params(self) -> int:
        return sum(v.meta.numel for v in self.params())

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node named {name!r} in graph {self.model_name!r}")

    def producers(self) -> dict[str, Node]:
        """Value name → the node that produces it (activations only)."""
        return {out: n for n in self.nodes for out in n.outputs}

    def consumers(self) -> dict[str, list[Node]]:
        """Value name → nodes that read it, in execution order."""
        users: dict[str, list[Node]] = {name: [] for name in self.values}
        for n in self.nodes:
            seen: set[str] = set()
            for ref in n.input_refs():
                if ref.name not in seen:
                    users[ref.name].append(n)
                    seen.add(ref.name)
        return users

    def grad_values(self) -> frozenset[str]:
        """Values that carry a gradient in backward: floating, and reached from a trainable
        parameter (or an input that requires one) through ops that pass gradients on. A
        mask made from the activations (``new_zeros``, a compare, ``one_hot``) is not one:
        autograd records nothing for it, so it saves nothing and sums nothing."""
        out: set[str] = {name for name, v in self.values.items() if v.requires_grad
                         and v.kind in ("param", "input") and v.meta.dtype.is_floating_point}
        for n in self.nodes:
            if n.target in NO_GRAD or not any(r.name in out for r in n.input_refs()):
                continue
            out.update(o for o in n.outputs if self.values[o].meta.dtype.is_floating_point)
        return frozenset(out)

    def batched_values(self) -> frozenset[str]:
        """Values made from a graph input. A pipeline splits every input into micro-batches
        along dim 0, so their work is shared out among them; any other value (a
        relative-position bias, rotary tables: parameters and constants alone) is made whole
        with each micro-batch, and has no batch or sequence axis to split. A read of an
        input's dtype alone counts too: ``x.new_zeros`` makes a tensor of the batch's shape."""
        out: set[str] = set(self.inputs)
        for node in self.nodes:
            if any(r.name in out for r in node.input_refs()):
                out.update(o for o in node.outputs if o)
        return frozenset(out)

    def input_metas(self, node: Node) -> list[TensorMeta]:
        return [self.values[r.name].meta for r in node.input_refs()]

    def output_metas(self, node: Node) -> list[TensorMeta]:
        return [self.values[o].meta for o in node.outputs]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)
