"""A captured graph as a file: capture a large model once, plan and simulate it many times.

``torchweave inspect MODEL --meta --save-graph gpt.graph.json`` writes it;
``plan``, ``simulate`` and ``explain`` take the path where they take MODEL.
The file is data, never code, and holds no weights: ops, their constant
arguments, every value's shape, dtype and kind, the inputs, outputs and loss.
What needs the weights (``verify``, ``train``) captures the model itself.

:func:`load_graph` checks everything before anything reads it:

- names (values, nodes, module paths, source lines) against short alphabets;
- each op's name is a registered op (:data:`~torchweave.ops.REGISTRY`), so
  nothing else is ever looked up on ``torch.ops``;
- arguments are JSON numbers, booleans, null, short strings, lists, and the
  tagged forms ``{"ref": NAME}`` (a value of the graph), ``{"tuple": [...]}``,
  ``{"dtype": NAME}``, ``{"device": "meta"}``, ``{"layout": NAME}``,
  ``{"memory_format": NAME}``, nothing else; a reference names a value the graph holds;
- shapes are lists of whole numbers; dtypes and layouts are torch's own, by
  name; every key is one the format has.

Annotations are not read from the file: they are derived again by the op
registry, as capture derives them. Lifted constant tensors are not kept (no
data); a graph that had some says so in ``meta["constants_dropped"]``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph, Node, Ref, TensorMeta, Value, part_target

VERSION = 1
SUFFIX = ".graph.json"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")
_PATH = re.compile(r"[A-Za-z0-9_.\-]{0,300}")
_TARGET = re.compile(r"[a-z_][a-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*")
_TEXT_LEN = 300
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64)}
_LAYOUTS = {"strided": torch.strided}
_MEMORY_FORMATS = {str(f).removeprefix("torch."): f for f in (
    torch.contiguous_format, torch.preserve_format, torch.channels_last, torch.channels_last_3d)}
_DEVICES = ("meta", "cpu", "cuda")
_GRAPH_KEYS = {"version", "model_name", "inputs", "outputs", "loss", "values", "nodes", "meta"}
_VALUE_KEYS = {"shape", "dtype", "kind", "target", "aliases", "requires_grad", "part"}
_NODE_KEYS = {"name", "target", "args", "kwargs", "outputs", "source", "source_line", "module",
              "output_structure"}
_KINDS = ("param", "buffer", "input", "activation")


class GraphFileError(TorchweaveError):
    """A graph file that is not what the format allows."""


# ------------------------------------------------------------------ writing
def _arg(x: Any) -> Any:
    if isinstance(x, Ref):
        return {"ref": x.name}
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"device": x.type}
    if isinstance(x, torch.layout):
        return {"layout": str(x).removeprefix("torch.")}
    if isinstance(x, torch.memory_format):  # clone(memory_format=...), as transformers writes
        return {"memory_format": str(x).removeprefix("torch.")}
    if isinstance(x, tuple):
        return {"tuple": [_arg(i) for i in x]}
    if isinstance(x, list):
        return [_arg(i) for i in x]
    if isinstance(x, dict):
        return {"dict": {str(k): _arg(v) for k, v in x.items()}}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise GraphFileError(Problem(obj="graph argument", value=type(x).__name__,
                                 rule="a graph file holds numbers, strings, dtypes, devices, "
                                      "layouts, memory formats and references",
                                 fix="report this op"))


def graph_to_json(graph: Graph) -> str:
    """``graph`` as the file's text (no weights, no constants' data)."""
    data = {
        "version": VERSION, "model_name": graph.model_name,
        "inputs": list(graph.inputs), "outputs": list(graph.outputs), "loss": graph.loss,
        "values": {n: {"shape": list(v.meta.shape), "dtype": str(v.meta.dtype).removeprefix("torch."),
                       "kind": v.kind, "target": v.target, "aliases": list(v.aliases),
                       "requires_grad": v.requires_grad,
                       **({"part": list(v.part)} if v.part is not None else {})}
                   for n, v in graph.values.items()},
        "nodes": [{"name": n.name, "target": n.target, "args": _arg(list(n.args)),
                   "kwargs": {k: _arg(v) for k, v in n.kwargs.items()},
                   "outputs": list(n.outputs), "source": n.source, "source_line": n.source_line,
                   "module": n.module, "output_structure": n.output_structure}
                  for n in graph.nodes],
        "meta": {"recycle": dict(graph.meta.get("recycle") or {}),
                 "mutated_buffers": list(graph.meta.get("mutated_buffers", [])),
                 "constants_dropped": sorted(graph.meta.get("constants", {}))},
    }
    return json.dumps(data, indent=0)


def save_graph(graph: Graph, path: str) -> None:
    with open(path, "w") as f:
        f.write(graph_to_json(graph))


# ------------------------------------------------------------------ reading
class _Reader:
    def __init__(self) -> None:
        self.problems: list[Problem] = []
        self.names: set[str] = set()

    def bad(self, obj: str, value: Any, rule: str, fix: str = "") -> None:
        shown = repr(value)
        self.problems.append(Problem(obj=f"graph file {obj}", value=shown[:80],
                                     rule=rule, fix=fix or "capture the model again "
                                     "(torchweave inspect MODEL --save-graph PATH)"))

    def text(self, obj: str, x: Any, pattern: re.Pattern[str] | None = None) -> str:
        if not isinstance(x, str) or (pattern is not None and not pattern.fullmatch(x)) or \
                len(x) > _TEXT_LEN or not x.isprintable():
            self.bad(obj, x, "a short printable string" + (" of the allowed characters"
                                                             if pattern is not None else ""))
            return ""
        return x

    def keys(self, obj: str, d: Any, allowed: set[str]) -> dict:
        if not isinstance(d, dict):
            self.bad(obj, type(d).__name__, "a JSON object")
            return {}
        extra = sorted(set(d) - allowed)
        if extra:
            self.bad(obj, extra, f"keys among {', '.join(sorted(allowed))}")
        return d

    def whole(self, obj: str, x: Any) -> int:
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            self.bad(obj, x, "a whole number >= 0")
            return 0
        return x

    def arg(self, obj: str, x: Any, depth: int = 0) -> Any:
        if depth > 8:
            self.bad(obj, "...", "arguments nest at most 8 deep")
            return None
        if x is None or isinstance(x, (bool, int)):
            return x
        if isinstance(x, float):
            return x
        if isinstance(x, str):
            return self.text(obj, x)
        if isinstance(x, list):
            return [self.arg(obj, i, depth + 1) for i in x]
        if isinstance(x, dict) and len(x) == 1:
            (tag, v), = x.items()
            if tag == "ref":
                name = self.text(f"{obj} reference", v, _IDENT)
                if name and name not in self.names:
                    self.bad(f"{obj} reference", v, "a value the graph holds")
                return Ref(name)
            if tag == "tuple" and isinstance(v, list):
                return tuple(self.arg(obj, i, depth + 1) for i in v)
            if tag == "dict" and isinstance(v, dict):
                return {self.text(f"{obj} key", k, _IDENT): self.arg(obj, i, depth + 1)
                        for k, i in v.items()}
            if tag == "dtype" and v in DTYPES:
                return DTYPES[v]
            if tag == "layout" and v in _LAYOUTS:
                return _LAYOUTS[v]
            if tag == "memory_format" and v in _MEMORY_FORMATS:
                return _MEMORY_FORMATS[v]
            if tag == "device" and v in _DEVICES:
                return torch.device(v)
        self.bad(obj, x, "a number, boolean, null, short string, list, or one of {'ref': NAME}, "
                         "{'tuple': [...]}, {'dict': {...}}, {'dtype': "
                         f"{'|'.join(DTYPES)}}}, {{'device': {'|'.join(_DEVICES)}}}, "
                         "{'layout': 'strided'}, "
                         f"{{'memory_format': {'|'.join(_MEMORY_FORMATS)}}}")
        return None

    def value(self, name: str, d: Any) -> Value | None:
        d = self.keys(f"value {name!r}", d, _VALUE_KEYS)
        shape = d.get("shape")
        if not isinstance(shape, list):
            self.bad(f"value {name!r} shape", shape, "a list of whole numbers")
            shape = []
        dims = tuple(self.whole(f"value {name!r} shape", s) for s in shape)
        dtype = DTYPES.get(d.get("dtype"))
        if dtype is None:
            self.bad(f"value {name!r} dtype", d.get("dtype"), f"one of {', '.join(DTYPES)}")
        kind = d.get("kind")
        if kind not in _KINDS:
            self.bad(f"value {name!r} kind", kind, f"one of {', '.join(_KINDS)}")
        aliases = d.get("aliases", [])
        if not isinstance(aliases, list):
            self.bad(f"value {name!r} aliases", aliases, "a list of module paths")
            aliases = []
        req = d.get("requires_grad", False)
        if not isinstance(req, bool):
            self.bad(f"value {name!r} requires_grad", req, "true or false")
        if dtype is None or kind not in _KINDS:
            return None
        part = self.part(name, d, dims, kind)
        target = d.get("target", "")
        if part is None:
            target = self.text(f"value {name!r} target", target, _PATH)
        elif target != part_target(part[0], part[1], part[2], part[2] + dims[part[1]]):
            self.bad(f"value {name!r} target", target, "a part's target names its module tensor "
                     f"and slice: {part_target(part[0], part[1], part[2], part[2] + dims[part[1]])}")
        return Value(name, TensorMeta(dims, dtype), kind, target,
                     tuple(self.text(f"value {name!r} alias", a, _PATH) for a in aliases),
                     req is True, part)

    def part(self, name: str, d: dict, dims: tuple[int, ...], kind: str) -> tuple[str, int, int] | None:
        """A parameter's ``part`` (module path, dim, start), checked; None without one."""
        if "part" not in d:
            return None
        x = d["part"]
        if kind != "param" or not isinstance(x, list) or len(x) != 3:
            self.bad(f"value {name!r} part", x, "a parameter's [module path, dim, start]")
            return None
        path = self.text(f"value {name!r} part path", x[0], _PATH)
        dim, start = self.whole(f"value {name!r} part dim", x[1]), self.whole(f"value {name!r} part start", x[2])
        if not path:
            self.bad(f"value {name!r} part path", x[0], "a module path")
            return None
        if dim >= len(dims) or dims[dim] == 0:
            self.bad(f"value {name!r} part dim", dim, f"a dim of its shape {list(dims)}, not empty")
            return None
        if d.get("aliases"):
            self.bad(f"value {name!r} aliases", d["aliases"], "none on a part")
        return path, dim, start

    def node(self, i: int, d: Any) -> Node | None:
        from torchweave.ops import REGISTRY

        d = self.keys(f"node {i}", d, _NODE_KEYS)
        name = self.text(f"node {i} name", d.get("name"), _IDENT)
        target = self.text(f"node {name or i} target", d.get("target"), _TARGET)
        if target and target not in REGISTRY:
            self.bad(f"node {name or i} target", target, "an op torchweave has an annotation for",
                     fix="register the op's annotation before loading (torchweave.ops.register_op)")
        args = self.arg(f"node {name or i} args", d.get("args", []))
        kwargs = d.get("kwargs", {})
        if not isinstance(kwargs, dict):
            self.bad(f"node {name or i} kwargs", kwargs, "a JSON object")
            kwargs = {}
        kw = {self.text(f"node {name or i} keyword", k, _IDENT):
              self.arg(f"node {name or i} kwargs", v) for k, v in kwargs.items()}
        outputs = d.get("outputs", [])
        if not isinstance(outputs, list):
            self.bad(f"node {name or i} outputs", outputs, "a list of value names")
            outputs = []
        outs = tuple(self.text(f"node {name or i} output", o, _IDENT) for o in outputs)
        for o in outs:
            if o and o not in self.names:
                self.bad(f"node {name or i} output", o, "a value the graph holds")
        structure = d.get("output_structure", "single")
        if structure not in ("single", "tuple"):
            self.bad(f"node {name or i} output_structure", structure, "single or tuple")
        if not isinstance(args, list):
            return None
        return Node(name, target, tuple(args), kw, outs,
                    self.text(f"node {name or i} source", d.get("source", ""), _PATH_OR_LINE),
                    self.text(f"node {name or i} source_line", d.get("source_line", "")),
                    self.text(f"node {name or i} module", d.get("module", ""), _PATH),
                    output_structure=structure if structure in ("single", "tuple") else "single")


_PATH_OR_LINE = re.compile(r"[A-Za-z0-9_./:\\\- ]{0,300}")


def graph_from_json(text: str) -> Graph:
    """The graph a file holds, every field checked (see the module docstring)."""
    from torchweave.ops import annotate

    try:
        data = json.loads(text)
    except ValueError as exc:
        raise GraphFileError(Problem(obj="graph file", value=str(exc)[:80], rule="valid JSON"))
    r = _Reader()
    data = r.keys("", data, _GRAPH_KEYS)
    if data.get("version") != VERSION:
        raise GraphFileError(Problem(obj="graph file", value=f"version {data.get('version')!r}",
                                     rule=f"this torchweave reads graph files of version {VERSION}",
                                     fix="capture the model again with this torchweave"))
    values_in = data.get("values")
    if not isinstance(values_in, dict):
        r.bad("values", type(values_in).__name__, "a JSON object")
        values_in = {}
    r.names = {n for n in values_in if isinstance(n, str) and _IDENT.fullmatch(n)}
    values = {}
    for name, d in values_in.items():
        if r.text("value name", name, _IDENT):
            v = r.value(name, d)
            if v is not None:
                values[name] = v
    _check_parts(r, values)
    nodes_in = data.get("nodes")
    if not isinstance(nodes_in, list):
        r.bad("nodes", type(nodes_in).__name__, "a list")
        nodes_in = []
    nodes = [n for n in (r.node(i, d) for i, d in enumerate(nodes_in)) if n is not None]
    ios = {}
    for key in ("inputs", "outputs"):
        got = data.get(key, [])
        got = got if isinstance(got, list) else []
        ios[key] = [r.text(f"{key} entry", x, _IDENT) for x in got]
        for x in ios[key]:
            if x and x not in values:
                r.bad(f"{key} entry", x, "a value the graph holds")
    loss = data.get("loss")
    if loss is not None and (not isinstance(loss, str) or loss not in values):
        r.bad("loss", loss, "null or a value the graph holds")
    meta = r.keys("meta", data.get("meta", {}), {"recycle", "mutated_buffers", "constants_dropped"})
    recycle = meta.get("recycle", {})
    if not isinstance(recycle, dict):
        r.bad("meta recycle", recycle, "a JSON object of input → module path")
        recycle = {}
    links = {r.text("meta recycle input", k, _IDENT): r.text("meta recycle output", v, _PATH)
             for k, v in recycle.items()}
    mutated = [r.text("meta mutated buffer", b, _PATH) for b in meta.get("mutated_buffers", [])
               if isinstance(meta.get("mutated_buffers"), list)]
    dropped = [r.text("meta constant", b, _PATH) for b in meta.get("constants_dropped", [])
               if isinstance(meta.get("constants_dropped"), list)]
    if r.problems:
        raise GraphFileError(r.problems, header=f"the graph file holds {len(r.problems)} "
                                                f"thing(s) the format does not allow")
    graph = Graph(nodes, values, ios["inputs"], ios["outputs"], loss,
                  r.text("model_name", data.get("model_name", ""), _PATH))
    graph.meta.update(mutated_buffers=mutated, constants_dropped=dropped)
    if links:
        graph.meta["recycle"] = links
    annotate(graph)
    return graph


def _check_parts(r: _Reader, values: dict[str, Value]) -> None:
    """The parts of one module tensor cut it along one dim, end to end from 0, once each."""
    cuts: dict[str, list[Value]] = {}
    for v in values.values():
        if v.part is not None:
            cuts.setdefault(v.part[0], []).append(v)
    whole = {t for v in values.values() if v.part is None for t in (v.target, *v.aliases)}
    for path, vs in cuts.items():
        if path in whole:
            r.bad(f"value {vs[0].name!r} part", path, "a module tensor is held whole or as parts, "
                  "not both")
        vs.sort(key=lambda v: v.part[2])  # type: ignore[index]
        dim, at = vs[0].part[1], 0  # type: ignore[index]
        rest = _without(vs[0].meta.shape, dim)
        for v in vs:
            if v.part[1] != dim or v.part[2] != at or _without(v.meta.shape, dim) != rest:  # type: ignore[index]
                r.bad(f"value {v.name!r} part", list(v.part), f"the parts of {path} cut one dim "  # type: ignore[arg-type]
                      "end to end, each starting where the one before stops, and agree on the "
                      "other dims")
                break
            at += v.meta.shape[dim]


def _without(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    return shape[:dim] + shape[dim + 1:]


def load_graph(path: str) -> Graph:
    with open(path) as f:
        return graph_from_json(f.read())


def is_graph_file(spec: str) -> bool:
    return isinstance(spec, str) and spec.endswith(SUFFIX)


__all__ = ["GraphFileError", "SUFFIX", "graph_from_json", "graph_to_json", "is_graph_file",
           "load_graph", "save_graph"]
