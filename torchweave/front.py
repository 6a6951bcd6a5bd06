"""What every rank's build starts from: the captured graph and the resolved plan.

:func:`capture_and_resolve` captures the model (one micro-batch's graph where a
pipeline or accumulation runs several) and resolves the plan on it, searching
where the plan asks for a search. :func:`shared_front` does that once per job:
rank 0 captures and resolves, and every other rank receives the graph and the
plan as data (the graph-file and plan JSON formats, checked by their loaders),
never as pickles. :mod:`torchweave.parallel` lowers what this module gives.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import torch
import torch.distributed as dist

from torchweave.api import capture
from torchweave.errors import Problem, TorchweaveError
from torchweave.graphfile import DTYPES, graph_from_json, graph_to_json
from torchweave.ir.graph import Graph
from torchweave.plan.plan import Plan
from torchweave.policies import PlanLike, resolve
from torchweave.policies.spec import merged_accum, micro_of, needs_search
from torchweave.runtime.broadcast import as_bytes, broadcast_tensor, broadcast_text
from torchweave.runtime.forked import in_child
from torchweave.runtime.groups import GroupCache


def _capture(model: torch.nn.Module, example_inputs: tuple[Any, ...], micro_batches: int,
             precision: str, graphs: dict | None = None) -> Graph:
    """The graph of one micro-batch; ``graphs`` caches it per (model, input shapes, micro, precision)."""
    key = (id(model), micro_batches, precision, tuple(
        (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in example_inputs))
    if graphs is not None and key in graphs:
        return graphs[key]
    graph = _capture_once(model, example_inputs, micro_batches, precision)
    if graphs is not None:
        graphs[key] = graph
    return graph


def _capture_once(model: torch.nn.Module, example_inputs: tuple[Any, ...], micro_batches: int,
                  precision: str) -> Graph:
    if micro_batches > 1:
        bad = [i for i, x in enumerate(example_inputs)
               if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] % micro_batches)]
        if bad:
            raise TorchweaveError(Problem(
                obj=f"example input {bad[0]}", value=str(tuple(example_inputs[bad[0]].shape)),
                rule=f"the batch divides into {micro_batches} micro-batches: "
                     f"{example_inputs[bad[0]].shape[0] if example_inputs[bad[0]].dim() else 0} "
                     f"% {micro_batches} != 0",
                fix="use a batch that is a multiple of the micro-batch count",
            ))
        example_inputs = tuple(x.chunk(micro_batches)[0] if isinstance(x, torch.Tensor) else x
                               for x in example_inputs)
    target, inputs = model, example_inputs
    if precision == "bf16":
        target = _meta_copy(model, torch.bfloat16)
        inputs = tuple(x.to(device="meta", dtype=torch.bfloat16 if x.is_floating_point() else x.dtype)
                       if isinstance(x, torch.Tensor) else x for x in example_inputs)
    return capture(target, inputs)


def _meta_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` on the meta device with floating tensors in ``dtype``, tied weights still tied.

    (``module.to("meta")`` makes a new parameter per module, so a tied pair would
    become two parameters, each trained on half its gradient.)
    """
    def meta(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(t, device="meta", dtype=dtype if t.is_floating_point() else t.dtype)
        return torch.nn.Parameter(out, t.requires_grad) if isinstance(t, torch.nn.Parameter) else out

    tensors = [t for _, t in (*model.named_parameters(remove_duplicate=False),
                              *model.named_buffers(remove_duplicate=False))]
    # deepcopy takes each tensor's copy from the memo: no data is copied, and a tensor
    # shared by two modules maps to one meta tensor
    return copy.deepcopy(model, {id(t): meta(t) for t in tensors})


def capture_and_resolve(model: torch.nn.Module, example_inputs: tuple[Any, ...], plan: PlanLike, *,
                        world_size: int, micro_batches: int = 1, precision: str = "fp32",
                        graphs: dict | None = None) -> tuple[Graph, Plan]:
    """The graph lowering reads (one micro-batch's, for a pipeline or accumulation) and the plan
    as resolved on it (see :func:`compile_plan`)."""
    k = merged_accum(plan, micro_batches)  # the plan's accum, or the step's grad_accum
    m = micro_of(plan, world_size) if k == 1 and not needs_search(plan) else None
    if m is not None and m > 1 and all(
            not isinstance(x, torch.Tensor) or (x.dim() > 0 and x.shape[0] % m == 0)
            for x in example_inputs):
        # a pipeline string: its micro-batch count is known, so one capture of one
        # micro-batch does (what the general path below ends with, after two)
        graph = _capture(model, example_inputs, m, precision, graphs)
        resolved = resolve(plan, graph, world_size)
        if resolved.pipeline is not None and resolved.pipeline.micro_batches == m:
            return graph, resolved
    graph = _capture(model, example_inputs, k, precision, graphs)
    if needs_search(plan):  # searched (or solved) once, on the whole batch
        from torchweave.search import resolve as resolve_auto  # only a search needs it

        resolved = resolve_auto(plan, graph, world_size)
        plan = resolved.notes["spec"]
    else:
        resolved = resolve(plan, graph, world_size)
    if resolved.accum != k and resolved.accum > 1:  # a policy function that set accum
        k = merged_accum(resolved, micro_batches)
        graph = _capture(model, example_inputs, k, precision, graphs)
        resolved = resolve(plan, graph, world_size)
    elif resolved.accum != k:  # what runs is written down: plan.json says accum
        resolved = dataclasses.replace(resolved, accum=k)
    pipe = resolved.pipeline
    if pipe is not None and k > 1:
        raise TorchweaveError(Problem(
            obj="StepConfig.grad_accum", value=str(k),
            rule=f"a pipelined plan ({resolved.name!r}) takes its micro-batches from the plan",
            fix=f"set grad_accum=1 (the plan runs {pipe.micro_batches} micro-batches), or raise "
                "the plan's micro (e.g. '1f1b:micro=8')"))
    if pipe is not None and pipe.micro_batches > 1 and k == 1:
        # a pipeline's forward sees one micro-batch: capture that shape, plan again on it
        graph = _capture(model, example_inputs, pipe.micro_batches, precision, graphs)
        if not isinstance(plan, Plan) and needs_search(plan):
            from torchweave.search import resolve as resolve_auto  # a solved split keeps the

            resolved = resolve_auto(plan, graph, world_size, like=resolved)  # whole batch's answer
        elif not isinstance(plan, Plan):
            resolved = resolve(plan, graph, world_size)
    return graph, resolved


class _Unwritable(Exception):
    """Rank 0's graph or plan does not fit their formats: every rank captures for itself."""


def _payload(model: torch.nn.Module, example_inputs: tuple[Any, ...], plan: PlanLike, *,
             world_size: int, micro_batches: int, precision: str) -> list[bytearray]:
    """Rank 0's capture and plan as what the other ranks receive: the header (graph file, plan
    JSON, each constant's name, dtype and shape) and each constant's bytes. Both texts pass
    their loaders here first (what the others would refuse is not sent: ``_Unwritable``)."""
    graph, resolved = capture_and_resolve(model, example_inputs, plan, world_size=world_size,
                                          micro_batches=micro_batches, precision=precision)
    consts = graph.meta.get("constants", {})
    try:
        text = graph_to_json(graph)
        graph_from_json(text)
        plan_text = resolved.to_json()
        Plan.from_json(plan_text)
        bad = [k for k, v in consts.items() if v.dtype not in DTYPES.values()]
        if bad:
            raise ValueError(f"constant {bad[0]} of dtype {consts[bad[0]].dtype}")
        data = [bytearray(as_bytes(v).numpy()) for v in consts.values()]
    except Exception as exc:  # noqa: BLE001 - any graph the format cannot hold
        raise _Unwritable(f"{type(exc).__name__}: {exc}"[:300]) from exc
    header = {"graph": text, "plan": plan_text,
              "constants": [[k, str(v.dtype).removeprefix("torch."), list(v.shape)]
                            for k, v in consts.items()]}
    return [bytearray(json.dumps(header).encode()), *data]


def _told(model: torch.nn.Module, example_inputs: tuple[Any, ...], plan: PlanLike, *,
          world_size: int, micro_batches: int, precision: str) -> list[bytearray]:
    """What rank 0 tells every rank (:func:`_payload`'s parts), or the JSON that says it
    could not: ``each`` (the format cannot hold the graph or plan) or ``error``."""
    try:
        return _payload(model, example_inputs, plan, world_size=world_size,
                        micro_batches=micro_batches, precision=precision)
    except _Unwritable as exc:
        return [bytearray(json.dumps({"each": str(exc)}).encode())]
    except Exception as exc:  # noqa: BLE001 - told to every rank, then raised on rank 0
        return [bytearray(json.dumps({"error": type(exc).__name__, "text": str(exc)[:2000]}).encode())]


def _from_rank0(header: dict) -> TorchweaveError:
    said = " / ".join(line.strip() for line in str(header.get("text", "")).splitlines())
    return TorchweaveError(Problem(
        obj="rank 0's capture and plan", value=str(header["error"])[:100],
        rule=f"rank 0 captures the model and resolves the plan for every rank; it "
             f"stopped with: {said}",
        fix="the fix rank 0's error names (every rank builds what rank 0 builds)"))


def _import_dynamo() -> None:
    # what the step needs anyway (every torch optimizer's constructor imports torch._dynamo,
    # ~1.5 s): on ranks other than 0 its import overlaps rank 0's capture
    import torch._dynamo  # noqa: F401


def shared_front(model: torch.nn.Module, example_inputs: tuple[Any, ...], plan: PlanLike, *,
                 groups: GroupCache, micro_batches: int = 1,
                 precision: str = "fp32") -> tuple[Graph, Plan] | None:
    """Capture and resolve on rank 0 alone; every rank then gets the graph and the plan as data.

    Capture (``torch.export``, and its import) and a searched plan cost seconds, and
    every rank of a job would pay them at once, on shared cores when ranks share a
    machine. Rank 0 does it, then broadcasts the graph in the graph-file format, the
    plan as plan JSON and the lifted constants as tensors: nothing is pickled, and
    both texts pass the loaders' checks (:func:`~torchweave.graphfile.graph_from_json`,
    :meth:`Plan.from_json`). Rank 0 reads what it sent, so every rank lowers the very
    same graph and plan.

    Rank 0 does the work in a forked child (:mod:`torchweave.runtime.forked`), so that
    what ``torch.export`` imports and caches does not stay in its memory (it imports
    ``torch._dynamo``, which the step needs too, before the fork); where it cannot fork,
    or the child fails, it does the work itself.

    Where rank 0 could not write its graph or plan in their formats, every rank
    captures and resolves for itself (the others get None). An error on rank 0 reaches
    every rank at once; rank 0 then raises the error itself.
    """
    if groups.world_size == 1 or not dist.is_initialized() or \
            dist.get_world_size() != groups.world_size:
        return None
    kw = dict(world_size=groups.world_size, micro_batches=micro_batches, precision=precision)
    if groups.rank == 0:
        _import_dynamo()  # before the fork: the child's capture reads it, not imports it again
        # the others wait for rank 0 in a broadcast; a child stuck longer than any collective
        # would wait (a lock another thread held at the fork) is killed, and rank 0 works here
        limit = max(groups.timeout_s, dist.default_pg_timeout.total_seconds())
        parts = in_child(lambda: _told(model, example_inputs, plan, **kw), timeout=limit)
        if parts is None:  # not forked, or the fork or the child failed: here
            parts = _told(model, example_inputs, plan, **kw)
        text = bytes(parts[0]).decode()
        broadcast_text(groups, text)  # what every rank is told, the error or "each" included
        header, data = json.loads(text), parts[1:]
        if "error" in header:  # the others stop now; here, the error itself (with its type)
            _payload(model, example_inputs, plan, **kw)
            raise _from_rank0(header)  # raised in the child but not here: say what the child met
        if "each" in header:  # the others capture and resolve for themselves, and so does rank 0
            return capture_and_resolve(model, example_inputs, plan, **kw)
    else:
        _import_dynamo()
        header = json.loads(broadcast_text(groups, None))
        if "error" in header:
            raise _from_rank0(header)
        if "each" in header:
            return None
    graph = graph_from_json(header["graph"])
    resolved = Plan.from_json(header["plan"])
    graph.meta["constants"] = {}
    for i, (k, dtype, shape) in enumerate(header["constants"]):
        here = (torch.frombuffer(data[i], dtype=torch.uint8) if len(data[i]) else
                torch.empty(0, dtype=torch.uint8)) if groups.rank == 0 else None
        graph.meta["constants"][k] = broadcast_tensor(groups, here, tuple(int(n) for n in shape),
                                                      DTYPES[dtype])
    return graph, resolved
