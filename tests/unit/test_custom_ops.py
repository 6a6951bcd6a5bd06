"""User ops: registered with an annotation, kept as one node, split like any op."""

from __future__ import annotations

from pathlib import Path
import warnings

import pytest
import torch
import torch.nn as nn

import torchweave
from torchweave.errors import AnnotationError, RegistryError
from torchweave.ops import REGISTRY, UnannotatedOpWarning
from torchweave.ops.selfcheck import Case, check_case


@torchweave.register_op("b s d^, d^ -> b s d^")
def tw_test_rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def tw_test_scaled_mm(x: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    return (x @ w) * scale


torchweave.register_op("m k+, k+ n -> m n", tw_test_scaled_mm)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(8) + 0.5)
        self.proj = nn.Parameter(torch.randn(8, 4))

    def forward(self, x):
        h = tw_test_rmsnorm(x, self.w)
        return torch.ops.torchweave_user.tw_test_scaled_mm(h.reshape(-1, 8), self.proj, 0.5).sum()


def test_custom_op_is_one_node_with_its_annotation() -> None:
    graph = torchweave.capture(Net(), (torch.randn(2, 4, 8),))
    nodes = {n.target: n for n in graph.nodes}
    assert nodes["torchweave_user.tw_test_rmsnorm.default"].annotation == "b s d^, d^ -> b s d^"
    assert nodes["torchweave_user.tw_test_scaled_mm.default"].annotation == "m k+, k+ n -> m n"


def test_custom_op_captures_on_meta() -> None:
    with torch.device("meta"):
        net, x = Net(), torch.randn(2, 4, 8)
    graph = torchweave.capture(net, (x,))
    assert graph.values[graph.loss].meta.shape == ()


def test_custom_op_gradients_match_the_function() -> None:
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 4, 8, requires_grad=True)
    net(x).backward()
    got = [net.w.grad.clone(), net.proj.grad.clone(), x.grad.clone()]
    net.zero_grad()
    x2 = x.detach().clone().requires_grad_()
    h = x2 * torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + 1e-6) * net.w
    ((h.reshape(-1, 8) @ net.proj) * 0.5).sum().backward()
    for a, b in zip(got, [net.w.grad, net.proj.grad, x2.grad]):
        torch.testing.assert_close(a, b)


def test_custom_op_splits_pass_the_self_check() -> None:
    op = torch.ops.torchweave_user.tw_test_scaled_mm.default
    case = Case("torchweave_user.tw_test_scaled_mm.default", op,
                (torch.randn(8, 16), torch.randn(16, 4), 0.5), {})
    assert check_case(case) == []
    assert "torchweave_user.tw_test_scaled_mm.default" in REGISTRY


def test_custom_op_needs_type_hints() -> None:
    with pytest.raises(RegistryError, match="type hints"):
        @torchweave.register_op("a -> a")
        def untyped(x):
            return x


def test_custom_op_output_dims_come_from_inputs() -> None:
    with pytest.raises(AnnotationError, match="output dim 'z'"):
        @torchweave.register_op("a -> a z")
        def grow(x: torch.Tensor) -> torch.Tensor:
            return x[:, None]


def test_unannotated_op_warns_once_and_runs_replicated() -> None:
    class M(nn.Module):
        def forward(self, x):
            return torch.special.erfcx(x).sum() + torch.special.erfcx(x * 2).sum()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = torchweave.capture(M(), (torch.randn(4, 4),))
    msgs = [str(w.message) for w in caught if issubclass(w.category, UnannotatedOpWarning)]
    assert len(msgs) == 1
    assert "special_erfcx" in msgs[0] and "test_custom_ops.py:" in msgs[0]
    assert "register_annotation" in msgs[0]
    node = next(n for n in graph.nodes if "erfcx" in n.target)
    assert node.annotation == "? -> ?"
    assert not torchweave.summarize(graph).rows[0].splittable.strip("-")


def test_register_annotation_for_an_existing_op() -> None:
    spec = torchweave.register_annotation("aten.special_erfcx", "a b -> a b", replace=True)
    try:
        x = torch.randn(4, 8)
        case = Case("aten.special_erfcx.default", torch.ops.aten.special_erfcx.default, (x,), {})
        assert check_case(case) == []
    finally:
        del REGISTRY.specs[spec.name]


def test_an_ops_info_is_remembered_until_its_annotation_or_registration_changes() -> None:
    """``ops.info`` is kept on the graph per node (plan builds and lowering ask again and
    again); an annotation written on the node, or an annotation registered for its op
    afterwards, is what the next call answers with."""
    from torchweave.ops import info

    class M(nn.Module):
        def forward(self, x):
            return torch.special.erfcx(x).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnannotatedOpWarning)
        graph = torchweave.capture(M(), (torch.randn(4, 8),))
    node = next(n for n in graph.nodes if "erfcx" in n.target)
    first = info(graph, node)
    assert info(graph, node) is first and first.replicate_only
    spec = torchweave.register_annotation("aten.special_erfcx", "a b -> a b", replace=True)
    try:
        node.annotation = None  # re-annotate from the registry
        now = info(graph, node)
        assert now is not first and now.spec is spec and not now.replicate_only
        node.annotation = "a b -> a b"
        assert str(info(graph, node).bound) == "a b -> a b"
    finally:
        del REGISTRY.specs[spec.name]
    assert info(graph, node).spec is None  # the registration is gone: asked afresh
    # a node's flattened arguments are remembered while its args are the same objects
    assert node.input_refs() and node.input_refs() == node.input_refs()
    node.args, node.kwargs = (), {}
    assert node.input_refs() == []
    # what a graph remembers stays behind when it is pickled for the ranks (an op rule's
    # local function would not pickle) or copied
    import copy
    import pickle

    for g in (pickle.loads(pickle.dumps(graph)), copy.deepcopy(graph)):
        assert "_op_infos" not in g.__dict__ and all("_flat" not in n.__dict__ for n in g.nodes)


def test_generated_code_imports_what_registers_a_library_custom_op(tmp_path) -> None:
    """A spawned rank that never imported the library still finds the op: its code imports it."""
    import subprocess
    import sys

    from tests.unit import custom_op_lib  # noqa: F401 - registers torch.ops.twlibtest.twice
    from torchweave.parallel import compile_plan

    class UsesLib(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.twlibtest.twice(self.proj(x)).sum()

    comp = compile_plan(UsesLib(), (torch.randn(2, 4),), "dp", world_size=2, code_dir=str(tmp_path))
    code = open(comp.code_paths[0]).read()
    assert "import tests.unit.custom_op_lib" in code
    check = ("import importlib.util, torch; s = importlib.util.spec_from_file_location('r', "
             f"{comp.code_paths[0]!r}); m = importlib.util.module_from_spec(s); "
             "s.loader.exec_module(m); print(hasattr(torch.ops.twlibtest, 'twice'))")
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=root)
    assert out.stdout.strip() == "True", out.stderr[-2000:]


def test_transformers_grouped_matmul_splits_pass_the_self_check() -> None:
    """The experts' grouped matmul of transformers' MoE layers (its float32 fallback) splits
    along the output features and the contraction, as annotated."""
    pytest.importorskip("transformers.integrations.moe")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(12, 8, generator=g), torch.randn(3, 8, 4, generator=g)
    offs = torch.tensor([5, 5, 12], dtype=torch.int32)  # an expert with no rows too
    op = torch.ops.transformers.grouped_mm_fallback.default
    case = Case("transformers.grouped_mm_fallback.default", op, (x, w, offs), {})
    assert REGISTRY.lookup(case.target) is not None
    assert check_case(case) == []
