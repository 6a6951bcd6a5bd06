"""Find the user's source line in stack traces and tracebacks."""

from __future__ import annotations

import linecache
import os
import re
import traceback
from dataclasses import dataclass

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MODELS_DIR = os.path.join(_OWN_DIR, "models")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


@dataclass(frozen=True)
class Location:
    """A source position in the user's code."""

    file: str
    line: int
    func: str = ""
    code: str = ""

    def __str__(self) -> str:
        return f"{_short(self.file)}:{self.line}"


def _short(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def is_user_file(path: str) -> bool:
    """True for code that is not PyTorch's or torchweave's own machinery.

    torchweave's bundled example models count as user code.
    """
    path = os.path.abspath(path)
    if path.startswith(_MODELS_DIR):
        return True
    if path.startswith(_TORCH_DIR) or path.startswith(_OWN_DIR):
        return False
    return not path.startswith("<")


def location_from_stack_trace(stack_trace: str | None) -> Location | None:
    """The innermost user frame in an fx node's ``stack_trace`` text."""
    if not stack_trace:
        return None
    lines = stack_trace.splitlines()
    best: Location | None = None
    for i, text in enumerate(lines):
        m = _FRAME.search(text)
        if m and is_user_file(m["file"]):
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            best = Location(m["file"], int(m["line"]), m["func"], code)
    return best


def location_from_exception(exc: BaseException) -> Location | None:
    """The innermost user frame of an exception, following its causes."""
    best: Location | None = None
    seen: set[int] = set()
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        for fs in traceback.extract_tb(e.__traceback__):
            if is_user_file(fs.filename):
                code = fs.line or linecache.getline(fs.filename, fs.lineno or 0).strip()
                best = Location(fs.filename, fs.lineno or 0, fs.name, code)
        if best is not None:
            return best
    # Some torch errors carry the user's frame only in their message.
    for m in _FRAME.finditer(str(exc)):
        if is_user_file(m["file"]):
            code = linecache.getline(m["file"], int(m["line"])).strip()
            best = Location(m["file"], int(m["line"]), m["func"], code)
    return best
