"""Bind an annotation to an op call's shapes: sizes, legal splits, FLOPs, bytes."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from torchweave.errors import AnnotationError, Problem
from torchweave.ir.graph import TensorMeta
from torchweave.ops.grammar import Annotation, Axis, Dim, TensorSpec, normalize_kinds, parse


@dataclass(frozen=True)
class Split:
    """One legal op-trans of an op: split ``dim`` into ``parts`` pieces."""

    dim: str
    parts: int
    kind: str
    """``spatial`` (outputs are concatenated) or ``reduce`` (outputs are partial)."""

    def __str__(self) -> str:
        return f"{self.dim}{'+' if self.kind == 'reduce' else ''}/{self.parts}"


@dataclass(frozen=True)
class Bound:
    """An annotation with ``...`` expanded and every dim given its size."""

    annotation: Annotation
    sizes: dict[str, int]

    def __str__(self) -> str:
        text = self.__dict__.get("_text")  # immutable, and written into every lowered call
        if text is None:
            text = str(self.annotation)
            object.__setattr__(self, "_text", text)
        return text

    def dim(self, name: str) -> Dim:
        return self.annotation.dims()[name]

    def splittable(self) -> list[str]:
        """Names that may be split: not frozen, not inside a group but first."""
        inner = {d.name for t in self.all_tensors() for a in t.axes for d in a.dims[1:]}
        return [
            d.name
            for d in self.annotation.dims().values()
            if d.kind != "frozen" and d.name not in inner and self.sizes[d.name] > 1
        ]

    def splits(self, max_parts: int | None = None) -> list[Split]:
        """Every legal (dim, parts): parts divides the dim's size."""
        out = []
        for name in self.splittable():
            size = self.sizes[name]
            kind = self.dim(name).kind
            for p in range(2, (max_parts or size) + 1):
                if size % p == 0:
                    out.append(Split(name, p, kind))
        return out

    def all_tensors(self) -> tuple[TensorSpec, ...]:
        return self.annotation.inputs + self.annotation.outputs

    def axis_of(self, spec: TensorSpec, name: str) -> int | None:
        """The axis index that ``name`` leads in ``spec`` (None if absent)."""
        for i, axis in enumerate(spec.axes):
            if axis.dims and axis.dims[0].name == name:
                return i
        return None

    def iteration_points(self) -> int:
        """Size of the iteration space: the product of every dim's size."""
        return math.prod(self.sizes.values())


def bind(
    text: str | Annotation,
    inputs: list[TensorMeta],
    outputs: list[TensorMeta],
    *,
    op: str = "op",
) -> Bound:
    """Check ``text`` against the tensors' shapes and bind each name's size.

    A text bound to the same shapes gives the same (immutable) :class:`Bound`, kept:
    a captured model's repeated blocks bind each op's annotation to the same shapes,
    once per block, and capture binds every node."""
    if isinstance(text, str):
        return _bind_text(text, tuple(inputs), tuple(outputs), op)
    return _bind(text, inputs, outputs, op=op)


@functools.lru_cache(maxsize=8192)
def _bind_text(text: str, inputs: tuple[TensorMeta, ...], outputs: tuple[TensorMeta, ...],
               op: str) -> Bound:
    return _bind(parse(text), list(inputs), list(outputs), op=op)


def _bind(ann: Annotation, inputs: list[TensorMeta], outputs: list[TensorMeta], *, op: str
          ) -> Bound:
    ann = normalize_kinds(ann)
    problems: list[Problem] = []
    where = f"{op} with annotation '{ann}'"
    for side, specs, metas in (("inputs", ann.inputs, inputs), ("outputs", ann.outputs, outputs)):
        if len(specs) != len(metas):
            problems.append(Problem(
                obj=where, value=f"{len(specs)} {side} annotated, {len(metas)} tensors",
                rule=f"the annotation names one entry per tensor {side[:-1]}",
                fix="add '?' for a tensor the op never splits",
            ))
    if problems:
        raise AnnotationError(problems)
    # Expand '...': every tensor's ellipsis shares names, aligned from the right.
    ell = max(
        (len(m.shape) - (len(s.axes) - 1) for s, m in zip(ann.inputs + ann.outputs, inputs + outputs)
         if any(a.ellipsis for a in s.axes)),
        default=0,
    )
    names = [f"e{i}" for i in range(max(ell, 0))]
    taken = set(ann.dims())
    names = [n if n not in taken else f"_{n}" for n in names]

    def expand(spec: TensorSpec, rank: int) -> TensorSpec:
        if spec.opaque or not any(a.ellipsis for a in spec.axes):
            return spec
        k = rank - (len(spec.axes) - 1)
        i = next(j for j, a in enumerate(spec.axes) if a.ellipsis)
        own = names[len(names) - k :] if k > 0 else []
        mid = tuple(Axis((Dim(n),)) for n in own)
        return TensorSpec(spec.axes[:i] + mid + spec.axes[i + 1 :])

    ins = tuple(expand(s, len(m.shape)) for s, m in zip(ann.inputs, inputs))
    outs = tuple(expand(s, len(m.shape)) for s, m in zip(ann.outputs, outputs))
    bound = Annotation(ins, outs)
    sizes: dict[str, int] = {}
    groups: list[tuple[Axis, int, str]] = []
    for label, specs, metas in (("input", ins, inputs), ("output", outs, outputs)):
        for idx, (spec, meta) in enumerate(zip(specs, metas)):
            if spec.opaque:
                continue
            tname = f"{label} {idx} {meta}"
            if len(spec.axes) != len(meta.shape):
                problems.append(Problem(
                    obj=where, value=f"{tname} annotated '{spec}' ({len(spec.axes)} axes)",
                    rule="each tensor's annotation has one entry per axis",
                ))
                continue
            for axis, size in zip(spec.axes, meta.shape):
                if not axis.dims:
                    if size != 1:
                        problems.append(Problem(obj=where, value=f"{tname}: '1' on an axis of {size}",
                                                rule="'1' marks a size-one axis"))
                elif len(axis.dims) == 1:
                    name = axis.dims[0].name
                    if sizes.setdefault(name, size) != size:
                        problems.append(Problem(
                            obj=where, value=f"{tname}: {name}={size}, elsewhere {sizes[name]}",
                            rule=f"dimension {name!r} has one size on every tensor",
                        ))
                else:
                    groups.append((axis, size, tname))
    for axis, size, tname in groups:
        unknown = [d.name for d in axis.dims if d.name not in sizes]
        known = math.prod(sizes[d.name] for d in axis.dims if d.name in sizes)
        if len(unknown) == 1 and known and size % known == 0:
            sizes[unknown[0]] = size // known
        elif unknown or known != size:
            problems.append(Problem(
                obj=where, value=f"{tname}: group '{axis}' on an axis of {size}",
                rule="a group's sizes multiply to its axis; each of its names is sized elsewhere",
            ))
    if problems:
        raise AnnotationError(problems)
    return Bound(bound, sizes)


def tensor_bytes(metas: list[TensorMeta]) -> int:
    return sum(m.nbytes for m in metas)
