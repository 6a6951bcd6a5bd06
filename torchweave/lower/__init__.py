"""Lowering: a graph and a plan become one ``Program`` per rank, communication derived.

The entry point is :func:`torchweave.lower.lower.lower`; ``Program`` and its instructions
are in :mod:`torchweave.lower.program`; the communication steps that
:func:`torchweave.lower.derive.derive` produces between layouts are in
:mod:`torchweave.lower.steps`. Only types are exported here: the functions ``lower`` and
``derive`` are named like their modules, and exporting them would hide the modules.
"""

from torchweave.lower.program import Comm, Compute, Program, Segment
from torchweave.lower.steps import Step

__all__ = ["Comm", "Compute", "Program", "Segment", "Step"]
