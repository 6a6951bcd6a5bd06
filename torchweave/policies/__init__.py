"""Built-in policies: functions that build a Plan from the primitives, and nothing else.

Each takes the captured graph and the world size (plus keyword options) and
returns a :class:`~torchweave.plan.Plan`. ``resolve`` turns a name, a policy
function or a Plan into a Plan.
"""

from __future__ import annotations

import functools
from typing import Callable, Union

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph
from torchweave.plan.plan import Plan
from torchweave.policies.data import dp, zero1, zero2, zero3
from torchweave.policies.expert import ep
from torchweave.policies.pipeline_policy import SCHEDULES
from torchweave.policies.pipeline_policy import interlaced
from torchweave.policies.pipeline_policy import pipeline as pipeline_policy
from torchweave.policies.random import random_plan
from torchweave.policies.tensor import sp, tp

Policy = Callable[..., Plan]
POLICIES: dict[str, Policy] = {
    "dp": dp, "zero1": zero1, "zero2": zero2, "zero3": zero3, "tp": tp, "sp": sp, "ep": ep,
    "random": random_plan,
    **{name: functools.partial(pipeline_policy, schedule=name) for name in SCHEDULES},
    "interlaced": interlaced,
}
PlanLike = Union[Plan, Policy, str]


def resolve(plan: PlanLike, graph: Graph, world_size: int) -> Plan:
    """A Plan from a Plan, a policy function, a plan.json path, or a plan string: a built-in
    policy's name with options (:mod:`torchweave.policies.spec`)."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, str) and plan.endswith(".json"):
        with open(plan) as f:
            return Plan.from_json(f.read())
    if isinstance(plan, str):  # a plan string: "zero3", "1f1b:tp=2,dp=2,recompute=full"
        from torchweave.policies.spec import PlanSpec

        return PlanSpec.parse(plan).build(graph, world_size)
    if callable(plan):
        out = plan(graph, world_size)
        if not isinstance(out, Plan):
            raise TorchweaveError(Problem(obj=f"policy {getattr(plan, '__name__', plan)}",
                                          value=type(out).__name__, rule="a policy returns a Plan"))
        return out
    raise TorchweaveError(Problem(obj="plan", value=type(plan).__name__,
                                  rule="a Plan, a policy function or a policy name"))


__all__ = ["POLICIES", "dp", "ep", "pipeline_policy", "resolve", "random_plan", "sp", "tp", "zero1", "zero2", "zero3"]
