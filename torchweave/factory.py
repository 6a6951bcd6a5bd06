"""Load a model the way every command does: ``file.py:factory`` or a bundled name.

A factory takes no arguments and returns ``(model, example_inputs)``, where
``example_inputs`` is a tuple of positional arguments; it may also return a
third item, a dict of keyword arguments.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from torchweave.errors import Problem, TorchweaveError


@dataclass
class Loaded:
    model: torch.nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    name: str = ""


def resolve(spec: str) -> Callable[[], Any]:
    """The factory named by ``spec``."""
    from torchweave.models import FACTORIES

    if spec in FACTORIES:
        return FACTORIES[spec]
    if spec.endswith(".graph.json"):
        raise TorchweaveError(Problem(
            obj="model", value=repr(spec),
            rule="a saved graph holds no weights: plan, simulate and explain take it, but what "
                 "runs the model (verify, train, demo) needs the model itself",
            fix="give the model's factory (path/to/file.py:factory or a bundled name)"))
    path, sep, attr = spec.rpartition(":")
    if not sep:
        raise TorchweaveError(Problem(
            obj="model", value=repr(spec),
            rule="a model is a bundled name or 'path/to/file.py:factory' or 'pkg.module:factory'",
            fix=f"bundled names: {', '.join(FACTORIES)}",
        ))
    if path.endswith(".py") or os.sep in path:
        if not os.path.exists(path):
            raise TorchweaveError(Problem(obj="model", value=path, rule="the file exists"))
        # As ``python file.py`` would: the file's folder is importable, so a model file
        # may import the modules beside it.
        folder = os.path.dirname(os.path.abspath(path))
        if folder not in sys.path:
            sys.path.insert(0, folder)
        modname = f"torchweave_user_model_{abs(hash(os.path.abspath(path)))}"
        mspec = importlib.util.spec_from_file_location(modname, path)
        assert mspec and mspec.loader
        module = importlib.util.module_from_spec(mspec)
        sys.modules[modname] = module
        mspec.loader.exec_module(module)
    else:
        module = importlib.import_module(path)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise TorchweaveError(Problem(
            obj=f"model {spec}", value=f"{attr!r}", rule=f"{path} defines a callable {attr}",
            fix="define `def factory(): return model, (example_inputs,)`",
        ))
    return fn


def load(spec: str, *, meta: bool = False) -> Loaded:
    """Call the factory (on the meta device when ``meta``) and check its result."""
    factory = resolve(spec)
    with torch.device("meta") if meta else nullcontext():
        result = factory()
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise TorchweaveError(Problem(
            obj=f"factory {spec}", value=type(result).__name__,
            rule="a factory returns (model, example_inputs) or (model, args, kwargs)",
        ))
    model, args, *rest = result
    if not isinstance(model, torch.nn.Module):
        raise TorchweaveError(Problem(obj=f"factory {spec}", value=type(model).__name__,
                                      rule="the first item is an nn.Module"))
    if not isinstance(args, tuple):
        raise TorchweaveError(Problem(
            obj=f"factory {spec}", value=f"example_inputs of type {type(args).__name__}",
            rule="example_inputs is a tuple", fix="return (model, (x,)) for one input",
        ))
    return Loaded(model, args, rest[0] if rest else {}, spec)
