"""User-registered ops: one annotated function becomes one splittable node.

``@torchweave.register_op("b s d, d -> b s d")`` turns a Python function into
a torch custom op (so torch.export keeps it as a single node), derives its
output shapes from the annotation (so it captures on meta tensors), gives it a
backward by re-running the function under autograd, and registers the
annotation so plans can split it like any built-in op.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Literal

import torch

from torchweave.errors import AnnotationError, Problem, RegistryError
from torchweave.ops.grammar import Annotation, TensorSpec, normalize_kinds, parse
from torchweave.ops.registry import REGISTRY, OpSpec, Rule

NAMESPACE = "torchweave_user"


def register_annotation(
    target: str | Any, annotation: str | Rule, *, partial: Literal["sum", "avg"] = "sum",
    flops_per_point: float = 1.0, replace: bool = False,
) -> OpSpec:
    """Annotate an existing op, e.g. ``register_annotation("aten.erfinv", "a b -> a b")``."""
    name = target if isinstance(target, str) else str(target)
    return REGISTRY.add(
        OpSpec(name=name, annotation=annotation, partial=partial, flops_per_point=flops_per_point),
        replace=replace,
    )


def batch_local(*targets: str | Any, dim: int = 0, replace: bool = True) -> list[OpSpec]:
    """Declare ops whose rows are independent along ``dim`` (a sort or a histogram per
    row, a library kernel applied row by row), so that data parallelism keeps the batch
    split through them instead of gathering it onto every device.

    Each call's tensors that share the first input's size along ``dim`` split along it
    together; every other axis, and every other tensor, stays whole. An output without
    that size makes the call run whole. A wrong declaration gives wrong results that
    ``torchweave verify`` reports against one device. Reached from the command line as
    ``--batch-local OP`` and from a train config as ``model.batch_local: [OP, ...]``.
    """
    specs = []
    for target in targets:
        name = target if isinstance(target, str) else str(target)
        if not all(part.isidentifier() for part in name.split(".")) or name.count(".") < 1:
            raise RegistryError(Problem(
                obj="batch_local", value=repr(name),
                rule="an op's qualified name: namespace.op or namespace.op.overload",
                fix="e.g. aten.sort or transformers.grouped_mm_fallback.default"))
        specs.append(REGISTRY.add(OpSpec(name=name, annotation=_rows_rule(dim),
                                         doc=f"declared batch-local along dim {dim}"),
                                  replace=replace))
    return specs


def _rows_rule(dim: int) -> Rule:
    def rule(call) -> str:
        tensors = [*call.inputs, *call.outputs]
        rank0 = len(call.inputs[0].shape) if call.inputs else 0
        d = dim % rank0 if rank0 and -rank0 <= dim < rank0 else 0
        size = call.inputs[0].shape[d] if rank0 and -rank0 <= dim < rank0 else None
        batched = [len(t.shape) > d and t.shape[d] == size for t in tensors]
        if size is None or not all(batched[len(call.inputs):]):
            taken = [" ".join(f"t{i}x{j}^" for j in range(len(t.shape))) or "()"
                     for i, t in enumerate(call.outputs)]
            return f"{', '.join(['?'] * len(call.inputs))} -> {', '.join(taken)}"
        specs = []
        for i, (t, b) in enumerate(zip(tensors, batched)):
            if not b:
                specs.append("?")
                continue
            axes = ["rows" if j == d else f"t{i}x{j}^" for j in range(len(t.shape))]
            specs.append(" ".join(axes))
        n = len(call.inputs)
        return f"{', '.join(specs[:n])} -> {', '.join(specs[n:])}"

    rule.__name__ = f"batch_local_dim{dim}"
    return rule


def register_op(
    annotation: str, fn: Callable[..., Any] | None = None, *, name: str | None = None,
    partial: Literal["sum", "avg"] = "sum", flops_per_point: float = 1.0,
) -> Any:
    """Register ``fn`` as a custom op with ``annotation``; usable as a decorator."""
    ann = normalize_kinds(parse(annotation))

    def wrap(func: Callable[..., Any]) -> Any:
        opname = name or func.__name__
        _check_signature(func, opname, annotation)
        _check_outputs_sized(ann, opname, annotation)
        qual = f"{NAMESPACE}::{opname}"
        try:
            op = torch.library.custom_op(qual, mutates_args=())(func)
        except (ValueError, RuntimeError) as exc:
            raise RegistryError(Problem(
                obj=f"register_op {opname}", value=str(exc).splitlines()[0],
                rule="torch.library.custom_op accepts the function",
                fix="annotate every parameter and the return type (torch.Tensor, int, float, bool)",
            )) from None
        op.register_fake(_fake(ann))
        _setup, _backward = _recompute_backward(func)
        op.register_autograd(_backward, setup_context=_setup)
        REGISTRY.add(OpSpec(name=f"{NAMESPACE}.{opname}.default", annotation=annotation,
                            partial=partial, flops_per_point=flops_per_point, doc=func.__doc__ or ""),
                     replace=True)
        return op

    return wrap(fn) if fn is not None else wrap


def _check_signature(func: Callable[..., Any], opname: str, text: str) -> None:
    sig = inspect.signature(func)
    missing = [p for p, v in sig.parameters.items() if v.annotation is inspect.Parameter.empty]
    if missing or sig.return_annotation is inspect.Signature.empty:
        raise RegistryError(Problem(
            obj=f"register_op({text!r}) on {opname}",
            value=f"parameters without type hints: {missing or ['return']}",
            rule="a custom op declares the type of each argument and of its result",
            fix=f"def {opname}(x: torch.Tensor, ...) -> torch.Tensor",
        ))


def _check_outputs_sized(ann: Annotation, opname: str, text: str) -> None:
    known = {n for t in ann.inputs for n in t.names()}
    for t in ann.outputs:
        for n in t.names():
            if n not in known:
                raise AnnotationError(Problem(
                    obj=f"register_op({text!r}) on {opname}", value=f"output dim {n!r}",
                    rule="every output dim of a custom op also names an input dim",
                    fix="name the output's dims after input dims so its shape can be derived",
                ))


def _fake(ann: Annotation) -> Callable[..., Any]:
    def fake(*args: Any, **kwargs: Any) -> Any:
        tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        sizes: dict[str, int] = {}
        for spec, t in zip(ann.inputs, tensors):
            for axis, size in zip(spec.axes, t.shape):
                if len(axis.dims) == 1:
                    sizes[axis.dims[0].name] = int(size)
        outs = [torch.empty(_shape(spec, sizes), dtype=tensors[0].dtype, device=tensors[0].device)
                for spec in ann.outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    return fake


def _shape(spec: TensorSpec, sizes: dict[str, int]) -> list[int]:
    shape = []
    for axis in spec.axes:
        size = 1
        for d in axis.dims:
            size *= sizes[d.name]
        shape.append(size)
    return shape


def _recompute_backward(func: Callable[..., Any]):
    """Backward that re-runs ``func`` under autograd on the saved inputs."""

    def setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.is_tensor = [isinstance(x, torch.Tensor) for x in inputs]
        ctx.consts = [None if t else x for x, t in zip(inputs, ctx.is_tensor)]
        ctx.save_for_backward(*[x for x in inputs if isinstance(x, torch.Tensor)])

    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        saved = iter(ctx.saved_tensors)
        args = []
        for is_t, const in zip(ctx.is_tensor, ctx.consts):
            if is_t:
                t = next(saved).detach()
                args.append(t.requires_grad_(t.is_floating_point()))
            else:
                args.append(const)
        with torch.enable_grad():
            out = func(*args)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        got = iter(torch.autograd.grad(outs, wrt, grads[: len(outs)], allow_unused=True))
        return tuple(next(got) if isinstance(a, torch.Tensor) and a.requires_grad else None
                     for a in args)

    return setup, backward


_BUILT_IN = ("aten", "prims", "torchweave")
"""Namespaces whose ops every rank has without importing anything."""


def defining_module(target: str) -> str | None:
    """The Python module whose import registers the custom op ``target`` (``ns.op.overload``),
    found from ``torch.library``'s records: the function of a ``custom_op``, else the fake
    kernel registered for it. ``None`` for built-in namespaces, and when neither record names
    a module (an op registered from C++, or defined in the launching script itself)."""
    parts = target.split(".")
    if len(parts) < 2 or parts[0] in _BUILT_IN:
        return None
    qualname = f"{parts[0]}::{parts[1]}"
    from torch._library import custom_ops, simple_registry

    found = custom_ops.OPDEFS.get(qualname)
    fn = getattr(found, "_init_fn", None) if found is not None else None
    if fn is None:
        entry = simple_registry.singleton.find(qualname)
        kernel = getattr(getattr(entry, "fake_impl", None), "kernel", None)
        fn = kernel
    module = getattr(fn, "__module__", None)
    if not isinstance(module, str) or module in ("__main__", "__mp_main__"):
        return None
    return module
