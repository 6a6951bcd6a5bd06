"""Model + example inputs → :class:`~torchweave.ir.Graph`, through torch.export.

The model may hold real tensors or meta tensors (build it under
``with torch.device("meta"):``); nothing here allocates weights, so a
175B-parameter configuration is captured in a few GB of host memory.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind

from torchweave.capture.normalize import normalize
from torchweave.capture.unfuse import unfuse
from torchweave.capture.regions import inline_regions
from torchweave.capture.source import location_from_exception, location_from_stack_trace
from torchweave.errors import CaptureError, Problem
from torchweave.ir.checker import check_graph
from torchweave.ir.graph import Graph, Node, Ref, TensorMeta, Value

# Ops that only assert metadata or are no-ops for a functional graph.
_DROPPED = {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default"}


def capture(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    *,
    name: str = "",
) -> Graph:
    """Capture ``model``'s forward pass on ``example_inputs`` as a Graph."""
    example_kwargs = dict(example_kwargs or {})
    if not isinstance(example_inputs, tuple):
        raise CaptureError(
            Problem(
                obj="example_inputs",
                value=type(example_inputs).__name__,
                rule="example inputs are a tuple of positional arguments",
                fix="wrap a single tensor as (tensor,)",
            )
        )
    arg_names = _bind_inputs(model, example_inputs, example_kwargs)
    try:
        with _no_kv_cache(model):
            ep = torch.export.export(model, example_inputs, example_kwargs, strict=False)
    except Exception as exc:  # noqa: BLE001 - every failure is reported the same way
        raise _capture_failure(model, exc, arg_names, example_inputs, example_kwargs) from exc
    _check_lookups(ep, model, arg_names, example_inputs, example_kwargs)
    inline_regions(ep)  # no_grad / autocast(enabled=False) blocks become plain ops
    if _mutates(ep):
        ep = _functional(ep, model, exc_args=(arg_names, example_inputs, example_kwargs))
    graph = _convert(model, ep, arg_names, name or type(model).__name__)
    normalize(graph)
    unfuse(graph)
    check_graph(graph)
    return graph


_FILLS = {"aten.fill_.Scalar", "aten.fill_.Tensor", "aten.zero_.default"}
"""Filling a fresh tensor (``torch.empty(...).fill_(x)``) sets its value, like a factory op: it
is left as traced."""


def _mutates(ep: torch.export.ExportedProgram) -> bool:
    """Whether the captured forward changes a tensor in place (``div_``, ``index_put_``, ...)."""
    for n in ep.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is None or not schema.is_mutable:
            continue
        src = n.args[0] if n.args else None
        fresh = isinstance(src, torch.fx.Node) and len(src.users) == 1 and \
            str(getattr(src, "target", "")).split(".")[1:2] in (["empty"], ["new_empty"])
        if (str(n.target) in _FILLS and fresh) or str(n.target) == "aten.detach_.default":
            continue  # detach_ changes no value (the graph is traced for its gradients anyway)
        return True
    return False


def _functional(ep: torch.export.ExportedProgram, model: torch.nn.Module,
                exc_args: tuple) -> torch.export.ExportedProgram:
    """The same program with every in-place op replaced by its functional form.

    An in-place op would reach the runtime as written, where it can land on the output of a
    collective (autograd refuses to modify that view) or on a tensor another rank's piece
    aliases. Functionalization (``run_decompositions({})``) also expands PyTorch's
    composite ops (``reshape`` into ``view``, ``dropout`` into ``native_dropout`` or a
    copy), so it is applied only to models that mutate.
    """
    try:
        return ep.run_decompositions({})
    except Exception as exc:  # noqa: BLE001 - reported like any capture failure
        raise _capture_failure(model, exc, *exc_args) from exc


@contextlib.contextmanager
def _no_kv_cache(model: torch.nn.Module):
    """Training builds no KV cache: a model that offers one (a transformers ``config`` with
    ``use_cache``) is captured with it off, then left as it was. With it on, a decoder
    concatenates each layer's keys onto an empty cache and returns the cache, ops that
    training never reads."""
    configs = {id(c): c for m in model.modules()
               if (c := getattr(m, "config", None)) is not None and getattr(c, "use_cache", False) is True}
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for c in configs.values():
            c.use_cache = True


def _bind_inputs(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[str]:
    """Check the inputs against ``forward``'s signature; return argument names."""
    sig = inspect.signature(model.forward)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        params = ", ".join(sig.parameters)
        raise CaptureError(
            Problem(
                obj=f"{type(model).__name__}.forward({params})",
                value=f"{len(args)} positional and {sorted(kwargs)} keyword example inputs",
                rule=f"example inputs bind to forward's parameters ({exc})",
                fix="make the factory return a tuple with one entry per forward argument",
            )
        ) from None
    return list(bound.arguments)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return str(TensorMeta.of(x))
    return repr(x)


def _check_lookups(ep: torch.export.ExportedProgram, model: torch.nn.Module,
                   arg_names: list[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse an embedding looked up by floating-point indices, as eager PyTorch does. Some
    releases' export raises there itself (2.13); others trace it (2.11), and the plan would
    then fail on the ranks, far from the cause."""
    for n in ep.graph.nodes:
        if n.op != "call_function" or str(n.target) != "aten.embedding.default":
            continue
        val = getattr(n.args[1], "meta", {}).get("val") if len(n.args) > 1 else None
        if isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex()):
            loc = location_from_stack_trace(n.meta.get("stack_trace"))
            given = dict(zip(arg_names, list(args) + list(kwargs.values())))
            inputs = ", ".join(f"{k}={_describe(v)}" for k, v in given.items())
            raise CaptureError(Problem(
                obj=f"{loc} `{loc.code}`" if loc else f"{type(model).__name__}.forward",
                value=f"embedding indices of dtype {val.dtype}",
                rule=f"an embedding looks rows up by integer indices (example inputs: {inputs})",
                fix="pass token ids as integers (torch.long)"),
                header=f"cannot capture {type(model).__name__}")


def _capture_failure(
    model: torch.nn.Module,
    exc: Exception,
    arg_names: list[str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> CaptureError:
    loc = location_from_exception(exc)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = f"{loc} `{loc.code}`" if loc else f"{type(model).__name__}.forward"
    given = dict(zip(arg_names, list(args) + list(kwargs.values())))
    inputs = ", ".join(f"{k}={_describe(v)}" for k, v in given.items())
    data_dependent = "data-dependent" in str(exc) or "DataDependent" in type(exc).__name__
    if data_dependent:
        rule = "control flow and shapes may depend on input shapes, not on tensor values"
        fix = (
            "replace the Python `if` on a tensor value with torch.where / masking, "
            "or move the check out of forward"
        )
    else:
        rule = f"torch.export must trace forward on the example inputs ({inputs})"
        fix = (
            "check that each example input has the shape and dtype forward expects; "
            "if the line uses Python that cannot be traced (numpy, .item(), I/O), "
            "rewrite it with torch ops"
        )
    return CaptureError(
        Problem(obj=where, value=f"{type(exc).__name__}: {text}", rule=rule, fix=fix),
        header=f"cannot capture {type(model).__name__}",
    )


def _param_groups(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Each parameter/buffer path → all paths of the same tensor (ties)."""
    by_id: dict[int, list[str]] = {}
    for path, t in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(t), []).append(path)
    for path, t in model.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(t), []).append(path)
    return {p: tuple(paths) for paths in by_id.values() for p in paths}


def _meta(val: Any) -> TensorMeta | None:
    if isinstance(val, torch.Tensor):
        return TensorMeta.of(val)
    return None


def _convert(
    model: torch.nn.Module, ep: torch.export.ExportedProgram, arg_names: list[str], name: str
) -> Graph:
    groups = _param_groups(model)
    values: dict[str, Value] = {}
    alias: dict[str, str] = {}  # fx node name → value name
    inputs: list[str] = []
    constants: dict[str, torch.Tensor] = {}
    user_inputs = iter(arg_names)
    kinds = {
        InputKind.PARAMETER: "param",
        InputKind.BUFFER: "buffer",
        InputKind.CONSTANT_TENSOR: "buffer",
    }
    canonical_value: dict[str, str] = {}  # canonical path → value name
    for spec in ep.graph_signature.input_specs:
        ph = spec.arg.name
        if spec.kind == InputKind.USER_INPUT:
            inputs.append(ph)
            meta = _meta(_placeholder_val(ep, ph))
            if meta is None:
                continue
            values[ph] = Value(ph, meta, "input", target=next(user_inputs, ph))
            alias[ph] = ph
            continue
        kind = kinds.get(spec.kind)
        if kind is None:
            raise CaptureError(
                Problem(obj=f"input {ph}", value=str(spec.kind), rule="supported input kinds")
            )
        target = spec.target or ph
        paths = groups.get(target, (target,))
        canon = paths[0]
        if spec.kind == InputKind.CONSTANT_TENSOR:
            constants[canon] = ep.constants[target]
        if canon in canonical_value:
            alias[ph] = canonical_value[canon]
            continue
        meta = _meta(_placeholder_val(ep, ph))
        assert meta is not None
        requires_grad = kind == "param" and bool(ep.state_dict[target].requires_grad)
        values[ph] = Value(ph, meta, kind, canon, paths[1:], requires_grad)
        alias[ph] = ph
        canonical_value[canon] = ph
    nodes = _convert_nodes(ep, values, alias)
    outputs: list[str] = []
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    out_specs = ep.graph_signature.output_specs
    changed = [s.target for s in out_specs if s.kind == OutputKind.PARAMETER_MUTATION]
    if changed:
        raise CaptureError(Problem(
            obj="forward", value=f"changes parameter(s) {', '.join(map(str, changed))} in place",
            rule="forward reads parameters; the optimizer changes them",
            fix="move the change out of forward (after optimizer.step(), or in a hook)"))
    for spec, arg in zip(out_specs, pytree.tree_leaves(out_node.args)):
        if spec.kind == OutputKind.USER_OUTPUT and isinstance(arg, torch.fx.Node):
            outputs.append(alias[arg.name])
    # Drop parameters nobody reads (the unused side of a tied pair, for one).
    used = {r.name for n in nodes for r in n.input_refs()} | set(outputs)
    for vname in [v for v, val in values.items() if val.kind != "activation" and v not in used]:
        if values[vname].kind != "input":
            del values[vname]
    loss = next(
        (o for o in outputs if values[o].meta.shape == () and values[o].meta.dtype.is_floating_point),
        None,
    )
    graph = Graph(nodes, values, [i for i in inputs if i in values], outputs, loss, name)
    graph.meta["constants"] = constants
    graph.meta["mutated_buffers"] = [
        s.target for s in out_specs if s.kind == OutputKind.BUFFER_MUTATION
    ]
    return graph


def _placeholder_val(ep: torch.export.ExportedProgram, name: str) -> Any:
    for n in ep.graph.nodes:
        if n.op == "placeholder" and n.name == name:
            return n.meta.get("val")
    return None


def _convert_nodes(
    ep: torch.export.ExportedProgram, values: dict[str, Value], alias: dict[str, str]
) -> list[Node]:
    nodes: list[Node] = []
    by_name: dict[str, Node] = {}

    def to_ref(x: Any) -> Any:
        if isinstance(x, torch.fx.Node):
            if x.name not in alias:
                raise CaptureError(
                    Problem(obj=f"node {x.name}", value=str(x.target), rule="supported node kinds")
                )
            return Ref(alias[x.name])
        return x

    for fx in ep.graph.nodes:
        if fx.op != "call_function":
            continue
        if fx.target is operator.getitem:
            src, idx = fx.args
            parent = by_name[alias.get(src.name, src.name)]
            outs = list(parent.outputs)
            values[fx.name] = Value(fx.name, TensorMeta.of(fx.meta["val"]), "activation")
            values.pop(outs[idx], None)
            outs[idx] = fx.name
            parent.outputs = tuple(outs)
            alias[fx.name] = fx.name
            continue
        target = str(fx.target)
        if target in _DROPPED:
            continue
        loc = location_from_stack_trace(fx.meta.get("stack_trace"))
        stack = fx.meta.get("nn_module_stack") or {}
        module = list(stack.values())[-1][0] if stack else ""
        val = fx.meta.get("val")
        if isinstance(val, (list, tuple)):
            outputs = tuple(f"{fx.name}__{i}" for i in range(len(val)))
            for oname, v in zip(outputs, val):
                meta = _meta(v)
                if meta is not None:
                    values[oname] = Value(oname, meta, "activation")
            structure = "tuple"
        else:
            outputs = (fx.name,)
            meta = _meta(val)
            if meta is None:
                raise CaptureError(
                    Problem(
                        obj=f"{loc or fx.name}",
                        value=f"{target} returns {type(val).__name__}",
                        rule="every op returns tensors",
                        fix="keep Python scalars out of forward's data flow",
                    )
                )
            values[fx.name] = Value(fx.name, meta, "activation")
            structure = "single"
        node = Node(
            name=fx.name,
            target=target,
            args=pytree.tree_map(to_ref, fx.args),
            kwargs=pytree.tree_map(to_ref, dict(fx.kwargs)),
            outputs=outputs,
            source=str(loc) if loc else "",
            source_line=loc.code if loc else "",
            module=module,
            output_structure=structure,
        )
        alias[fx.name] = fx.name
        by_name[fx.name] = node
        nodes.append(node)
    # Outputs of multi-output ops that nobody reads keep their generated names.
    return nodes
