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
from torchweave.policies.pipeline import SCHEDULES
from torchweave.policies.pipeline import interlaced
from torchweave.policies.pipeline import pipeline as pipeline_policy
from torchweave.policies.random import random_plan
from torchweave.policies.tensor import sp, tp

Policy = Callable[..., Plan]
POLICIES: dict[str, Policy] = {
    "dp": dp, "zero1": zero1, "zero2": zero2, "zero3": zero3, "tp": tp, "sp": sp,
    "random": random_plan,
    **{name: functools.partial(pipeline_policy, schedule=name) for name in SCHEDULES},
    "interlaced": interlaced,
}
_PIPELINE_OPTIONS = ("pp", "tp", "dp", "micro", "virtual", "stages", "zero", "recycle")
PlanLike = Union[Plan, Policy, str]


def resolve(plan: PlanLike, graph: Graph, world_size: int) -> Plan:
    """A Plan from a Plan, a policy function, a built-in policy's name or a plan.json path."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, str) and plan.endswith(".json"):
        with open(plan) as f:
            return Plan.from_json(f.read())
    if isinstance(plan, str) and ":" in plan:
        return _with_options(plan, graph, world_size)
    if isinstance(plan, str):
        if plan not in POLICIES:
            raise TorchweaveError(Problem(
                obj="plan", value=repr(plan), rule=f"a built-in policy: {', '.join(POLICIES)}",
                fix="pass a Plan, a policy function, or one of these names",
            ))
        return POLICIES[plan](graph, world_size)
    if callable(plan):
        out = plan(graph, world_size)
        if not isinstance(out, Plan):
            raise TorchweaveError(Problem(obj=f"policy {getattr(plan, '__name__', plan)}",
                                          value=type(out).__name__, rule="a policy returns a Plan"))
        return out
    raise TorchweaveError(Problem(obj="plan", value=type(plan).__name__,
                                  rule="a Plan, a policy function or a policy name"))


def _with_options(text: str, graph: Graph, world_size: int) -> Plan:
    """``"1f1b:micro=8,tp=2"``: a pipeline schedule's name with overridden defaults."""
    name, _, rest = text.partition(":")
    if name == "interlaced" and rest.startswith("micro=") and rest[6:].isdigit():
        return interlaced(graph, world_size, micro=int(rest[6:]))
    problems, options = [], {}
    if name not in SCHEDULES:
        problems.append(Problem(obj="plan", value=repr(text),
                                rule=f"options follow a pipeline schedule's name: {', '.join(SCHEDULES)}"))
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if key not in _PIPELINE_OPTIONS or not eq or not value.isdigit():
            problems.append(Problem(obj=f"plan {text!r}", value=repr(item),
                                    rule=f"options are KEY=N with KEY one of {', '.join(_PIPELINE_OPTIONS)}",
                                    fix="e.g. '1f1b:micro=8,tp=2'"))
            continue
        options[key] = int(value)
    if problems:
        raise TorchweaveError(problems)
    return pipeline_policy(graph, world_size, schedule=name, **options)


__all__ = ["POLICIES", "dp", "pipeline_policy", "resolve", "random_plan", "sp", "tp", "zero1", "zero2", "zero3"]
