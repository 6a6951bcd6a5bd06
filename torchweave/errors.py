"""Errors that name the user's object, the bad value, the rule and a fix.

Every error torchweave raises before launch is a :class:`TorchweaveError`. It
can carry several problems at once, so that a user sees all of them in one run
(JAX style), not one per attempt.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One thing that is wrong."""

    obj: str
    """The user's object: an op, a parameter, an argument, a field."""
    value: str
    """The bad value, printed."""
    rule: str
    """The rule it breaks."""
    fix: str = ""
    """What to do about it."""

    def render(self) -> str:
        lines = [f"{self.obj}: {self.value}", f"  rule: {self.rule}"]
        if self.fix:
            lines.append(f"  fix:  {self.fix}")
        return "\n".join(lines)


class TorchweaveError(Exception):
    """Base error; holds one or more :class:`Problem`."""

    def __init__(self, problems: Problem | list[Problem], header: str = ""):
        self.problems = [problems] if isinstance(problems, Problem) else list(problems)
        self.header = header
        super().__init__(self._message())

    def _message(self) -> str:
        parts = [self.header] if self.header else []
        if len(self.problems) > 1:
            parts.append(f"{len(self.problems)} problems:")
        parts.extend(p.render() for p in self.problems)
        return "\n".join(parts)


class AnnotationError(TorchweaveError):
    """A malformed annotation, or one that does not fit the op's tensors."""


class CaptureError(TorchweaveError):
    """A model that cannot be captured, or inputs that do not fit it."""


class RegistryError(TorchweaveError):
    """A bad op registration."""


class SimError(TorchweaveError):
    """A bad device, cluster or cost-model input (``torchweave.sim``)."""


class ModelReleased(TorchweaveError):
    """A batch of new shapes needs the model given to ``parallelize``, and the caller no
    longer holds it (``parallelize`` holds it weakly)."""
