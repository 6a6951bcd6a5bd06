"""Plans: op-trans, op-assign and op-order decisions as plain data, and their checks.

``Plan`` is the one type that built-in policies, user policies and the search all build
(:mod:`torchweave.plan.plan`); :func:`torchweave.plan.validate.validate` checks one against a
graph before anything runs; ``Mesh`` names the device mesh whose axes the plan's groups come
from. Only types are exported here: a function named like its module (``validate``) would
hide the module.
"""

from torchweave.plan.layout import Layout, Mesh, Piece
from torchweave.plan.stage_plan import Pipeline
from torchweave.plan.plan import Order, PieceRef, Plan, Trans
from torchweave.plan.validate import PlanError

__all__ = ["Layout", "Mesh", "Order", "Piece", "PieceRef", "Pipeline", "Plan", "PlanError", "Trans"]
