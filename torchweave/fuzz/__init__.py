"""Fuzzing the whole plan space: seeded draws, each rejected before launch or verified.

``bench/fuzz.py`` is the command; :func:`draw` and :func:`run` are the pieces.
"""

from torchweave.fuzz.draw import MODELS, Draw, build_plan, draw
from torchweave.fuzz.run import Outcome, run, table

__all__ = ["MODELS", "Draw", "Outcome", "build_plan", "draw", "run", "table"]
