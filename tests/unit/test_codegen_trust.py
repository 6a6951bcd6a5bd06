"""Generated code holds outside strings only escaped, or as checked identifiers."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from tests.conftest import captured
from torchweave.codegen.fuse import fuse_bias
from torchweave.codegen.render import render
from torchweave.codegen.safe import CodegenError
from torchweave.lower.lower import lower
from torchweave.lower.program import Compute
from torchweave.parallel import compile_plan
from torchweave.policies import resolve
from torchweave.runtime.executor import RankModule
from torchweave.runtime.groups import GroupCache


def _run_module_level(src: str) -> ast.Module:
    """Parse ``src`` and run its top level (imports, constants, definitions) as import does."""
    tree = ast.parse(src)
    exec(compile(tree, "<generated>", "exec"), {"__name__": "generated"})  # noqa: S102
    return tree


def _top_level_kinds(tree: ast.Module) -> list[str]:
    return sorted({type(s).__name__ for s in tree.body})


def _payload(marker: Path) -> str:
    return f"__import__('os').system('touch {marker}')"


@pytest.mark.parametrize("breaker", ['"""', "\n", "\r", "\u2028", "\\"])
def test_header_and_comments_cannot_be_left(tmp_path: Path, breaker: str) -> None:
    """A plan name, mesh and comments past the plan's checks (a program built by hand)."""
    marker = tmp_path / "marker"
    hostile = f"x{breaker}\n{_payload(marker)}\n{breaker}"
    graph = captured("gpt-tiny")
    prog = lower(graph, resolve("tp", graph, 2))[0]
    prog.plan_name, prog.mesh = hostile, hostile
    prog.instrs = [dataclasses.replace(i, comment=hostile) if isinstance(i, Compute) else i
                   for i in prog.instrs]
    src = render(prog)
    tree = _run_module_level(src)
    assert not marker.exists()
    assert _top_level_kinds(tree) == ["Assign", "Expr", "FunctionDef", "Import", "ImportFrom"]
    doc = ast.get_docstring(tree)
    assert repr(hostile) in doc and "mesh x" in doc
    commented = [line for line in src.splitlines() if "# x" in line]
    rendered = fuse_bias(prog, prog.instrs, {prog.loss or ""})  # a bias add joins its product's line
    assert len(rendered) < len(prog.instrs)
    assert len(commented) == sum(isinstance(i, Compute) for i in rendered)
    assert all(_payload(marker) in line for line in commented)


@pytest.mark.parametrize("field,value", [
    ("outputs", ("x = __import__('os')",)),
    ("outputs", ("if",)),
    ("fn", "aten.mm.default(); __import__('os').system('true')#"),
    ("kwargs", {"dim); __import__('os').system('true'); (": 1}),
])
def test_a_name_that_is_no_identifier_is_refused(field: str, value) -> None:
    graph = captured("gpt-tiny")
    prog = lower(graph, resolve("dp", graph, 1))[0]
    i = next(k for k, ins in enumerate(prog.instrs) if isinstance(ins, Compute) and ins.outputs)
    prog.instrs[i] = dataclasses.replace(prog.instrs[i], **{field: value})
    with pytest.raises(CodegenError) as info:
        render(prog)
    shown = repr(value[0] if field == "outputs" else next(iter(value)) if field == "kwargs"
                 else value)
    assert shown in str(info.value), str(info.value)
    assert f"node {prog.instrs[i].node!r}" in str(info.value)


@pytest.mark.parametrize("name", ["C", "p2p", "torch", "p"])
def test_a_local_that_would_shadow_generated_code_is_refused(name: str) -> None:
    """A graph file may name a value after the code's own imports or arguments."""
    graph = captured("gpt-tiny")
    prog = lower(graph, resolve("dp", graph, 1))[0]
    i = next(k for k, ins in enumerate(prog.instrs) if isinstance(ins, Compute) and ins.outputs)
    prog.instrs[i] = dataclasses.replace(prog.instrs[i], outputs=(name,))
    with pytest.raises(CodegenError, match="keeps .* for its own imports"):
        render(prog)


def test_a_hostile_module_name_reaches_code_only_as_a_repr(tmp_path: Path) -> None:
    """A submodule named to close a docstring: its code runs and matches the model."""
    marker = tmp_path / "marker"
    name = f'x"""\ngetattr(__import__(\'os\'), \'system\')(\'touch {marker}\')\n"""'.replace(
        ".", "_")  # module names hold no dots

    class Hostile(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.add_module(name, nn.Linear(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return getattr(self, name)(x).pow(2).mean()

    torch.manual_seed(0)
    model, x = Hostile(), torch.randn(2, 4)
    compiled = compile_plan(model, (x,), "dp", world_size=1, code_dir=str(tmp_path / "code"))
    src = Path(compiled.code_paths[0]).read_text()
    assert f"p[{f'{name}.weight'!r}]" in src
    group_cache = GroupCache(rank=0, world_size=1, timeout_s=5.0, device=torch.device("cpu"))
    module = RankModule(compiled.programs[0], compiled.code_paths[0], compiled.state, group_cache)
    loss = module.backward_step(x)
    assert abs(loss - float(model(x).detach())) < 1e-6
    assert not marker.exists()
