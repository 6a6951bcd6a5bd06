"""The public entry points."""

from __future__ import annotations

from typing import Any

import torch

from torchweave.capture import capture as _capture
from torchweave.ir.graph import Graph
from torchweave.ops import annotate
from torchweave.ops.moe import experts_as_one_op


def capture(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    *,
    name: str = "",
) -> Graph:
    """Capture ``model``'s forward pass (and loss) as an annotated :class:`Graph`.

    Works on real tensors, and on meta tensors for models too large to
    allocate: build the model and inputs under ``with torch.device("meta"):``.
    A model that recycles declares ``recycle = {input: module}`` (see
    :mod:`torchweave.plan.recycle`); it is kept in ``graph.meta["recycle"]``. The experts
    of transformers' mixture-of-experts layers are captured as one op each
    (:mod:`torchweave.ops.moe`), so that ``ep`` can split them; their paths are in
    ``graph.meta["experts"]``.
    """
    with experts_as_one_op(model) as experts:  # transformers' experts: one splittable op
        graph = _capture(model, example_inputs, example_kwargs, name=name)
    if experts:
        graph.meta["experts"] = experts
    annotate(graph)
    recycle = getattr(model, "recycle", None)
    if isinstance(recycle, dict) and all(isinstance(k, str) and isinstance(v, str)
                                         for k, v in recycle.items()):
        graph.meta["recycle"] = dict(recycle)
    return graph
