"""The simulator's step protocol and the rules it shares with the runtime and the schedules."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from tests.unit.test_sim_symmetry import _gpt
from torchweave.lower.lower import lower
from torchweave.lower.units import read_order, unit_key
from torchweave.policies import resolve
from torchweave.runtime.zero import _Units
from torchweave.sim import parse_cluster
from torchweave.sim.hardware.compute import ComputeModel
from torchweave.sim.step.build import Builder
from torchweave.sim.step.forward import forward
from torchweave.sim.step.signals import Copying, Of, Renamed, Signal, grad, regathered

SIM = Path(__file__).resolve().parents[2] / "torchweave" / "sim"


def test_zero3_units_are_the_runtimes() -> None:
    """The units the simulator gathers are the ones the runtime lays out, parameter by
    parameter (one rule: ``lower/units.py``)."""
    g = _gpt(3, batch=4)
    plan = resolve("zero3", g, 2)
    cluster = parse_cluster("2xA100-80GB-SXM")
    b = Builder(g, plan, cluster, None, ComputeModel.for_device(cluster.device), 25 * 2**20)
    for prog in lower(g, plan):
        _, state = forward(b, prog)
        sim = [[prog_param(prog, p) for p in state.members[u]] for u in sorted(state.members)]
        owned = [s for s in read_order(prog) if s.requires_grad and not s.is_buffer and s.grad_groups]
        pieces = [torch.empty([hi - lo for lo, hi in s.box]) for s in owned]
        layout = _Units(pieces, [unit_key(s.path) for s in owned], size=2)
        runtime = [[owned[i].path for i in idx] for idx in layout.units]
        assert sim == runtime and len(runtime) >= 4  # embeddings, 3 blocks, the head


def prog_param(prog, local: str) -> str:
    return next(s.path for s in prog.params if s.local == local)


def test_ready_names_of_different_kinds_never_meet() -> None:
    """A value, its gradient, its regathered parameter and their copies are distinct names
    in the engine's ready table, whatever the value is called."""
    names = ["w", grad("w"), regathered("w"), Signal(Of.OPTIMIZER), Signal(Of.SYNCED, "w"),
             Renamed("w", Copying.MICRO, 1), Renamed("w", Copying.BLOCK, 1),
             Renamed(grad("w"), Copying.MICRO, 1)]
    assert len(set(names)) == len(names)
    assert len({hash(n) for n in names}) == len(names)


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):  # lazy imports too
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torchweave.sim"):
            out.add(node.module)
    return out


def test_the_simulator_has_no_import_cycles() -> None:
    """Not even through imports inside functions (import-linter checks the layers)."""
    mods = {}
    for p in SIM.rglob("*.py"):
        name = ".".join(("torchweave", *p.relative_to(SIM.parent).with_suffix("").parts))
        mods[name.removesuffix(".__init__")] = _imports(p) - {name}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(mods.get(m, ())):
            if d not in mods or d == "torchweave.sim":
                continue
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(mods):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles
    assert len(mods) > 25
