"""The op registry: each op's annotation and the few rules it may need.

An entry is keyed by an op's qualified name (``aten.add.Tensor``) or by its
overload packet (``aten.add``, meaning every overload). Most entries are one
annotation string. A *rule* is a function of the call (shapes and constant
arguments) that returns the annotation, for ops whose dimensions depend on
their arguments (``view``, ``transpose``, ``sum(dim=…)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from torchweave.errors import Problem, RegistryError
from torchweave.ir.graph import TensorMeta


@dataclass(frozen=True)
class Call:
    """An op call as rules see it: constant arguments, tensors as TensorMeta."""

    target: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: list[TensorMeta]
    outputs: list[TensorMeta]

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """Positional argument ``index``, or keyword ``name``, or ``default``."""
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)

    @property
    def rank(self) -> int:
        """Rank of the first tensor input."""
        return len(self.inputs[0].shape)


Rule = Callable[[Call], str]


@dataclass(frozen=True, kw_only=True)
class OpSpec:
    """How one op may be split."""

    name: str
    """Qualified op name or overload packet."""
    annotation: str | Rule
    """The annotation, or a rule that returns it for a call."""
    partial: Literal["sum", "avg", "lse"] = "sum"
    """How partial outputs of a split reduction combine: add, average, or
    log-sum-exp (``log Σ exp``)."""
    flops: Callable[[Call, Any], float] | None = None
    """FLOPs of one forward call; default: ``flops_per_point`` × iteration space
    for ops with a reduction, else × the largest output."""
    flops_per_point: float = 1.0
    bwd_factor: float = 2.0
    """Backward FLOPs as a multiple of forward FLOPs."""
    shape_arg: tuple[int, str] | None = None
    """(position, keyword) of an argument holding the output shape; each piece
    gets its own local output shape there."""
    local: Callable[..., tuple[tuple[Any, ...], dict[str, Any]]] | None = None
    """Custom rewrite of a piece's call: ``local(args, kwargs, split, index, sizes)`` → (function,
    args, kwargs), or None to leave it. Lowering asks once per split dim, and once with
    ``split.dim`` None for a whole piece."""
    route: tuple[int, str] | None = None
    """``(input position, dim)``: that input holds coordinates along ``dim`` (a routing
    index, as a mixture of experts' ``index[t, j]`` names experts ``e``), and the output is a
    sum over ``dim`` in which a row's terms are the coordinates its index row holds. Where a
    plan splits ``dim``, lowering may then send each row only to the pieces its index routes
    it to (:mod:`torchweave.lower.route`) instead of gathering every row."""
    random: bool = False
    """Draws random numbers: pieces cannot be compared with the whole by value."""
    doc: str = ""

    def annotate(self, call: Call) -> str:
        return self.annotation(call) if callable(self.annotation) else self.annotation


@dataclass
class Registry:
    """Op name → :class:`OpSpec`."""

    specs: dict[str, OpSpec] = field(default_factory=dict)

    def add(self, spec: OpSpec, *, replace: bool = False) -> OpSpec:
        if spec.name in self.specs and not replace:
            raise RegistryError(Problem(
                obj=f"op {spec.name}", value="registered twice",
                rule="each op has one annotation", fix="pass replace=True to override it",
            ))
        if isinstance(spec.annotation, str):
            from torchweave.ops.grammar import parse

            parse(spec.annotation)
        self.specs[spec.name] = spec
        return spec

    def lookup(self, target: str) -> OpSpec | None:
        """Exact name first, then the overload packet."""
        if target in self.specs:
            return self.specs[target]
        packet = target.rsplit(".", 1)[0]
        return self.specs.get(packet)

    def __contains__(self, target: str) -> bool:
        return self.lookup(target) is not None

    def __len__(self) -> int:
        return len(self.specs)


REGISTRY = Registry()


def op(
    names: str | list[str], annotation: str | Rule, **options: Any
) -> list[OpSpec]:
    """Register built-in ops (used by :mod:`torchweave.ops.aten`)."""
    names = [names] if isinstance(names, str) else names
    return [REGISTRY.add(OpSpec(name=n, annotation=annotation, **options)) for n in names]
