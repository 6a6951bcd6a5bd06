"""Fused projections (one matmul for q, k and v, then cuts of its output) are captured as one
projection per part, so that tensor parallelism splits attention by heads: the graph, what is
left alone, the numbers, the graph file and the way back to the model's own names."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchweave
from tests.conftest import built
from torchweave.errors import TorchweaveError
from torchweave.graphfile import graph_from_json, graph_to_json
from torchweave.ir import run_graph
from torchweave.ir.graph import join_parts, param_tensor
from torchweave.parallel import model_state
from torchweave.policies import resolve


class FusedBlock(nn.Module):
    """Attention with one ``qkv`` projection cut by ``split`` (GPT-2's way, with grouped
    heads: 4 query heads, 2 key/value heads) and an MLP with one ``gate_up`` cut by ``chunk``."""

    def __init__(self, d: int = 32, heads: int = 4, kv: int = 2, tied: bool = False) -> None:
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, d // heads
        self.qkv = nn.Linear(d, (heads + 2 * kv) * self.hd)
        self.out = nn.Linear(d, d, bias=False)
        self.gate_up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.head = nn.Linear(d, 16, bias=False)
        if tied:  # the fused weight also read elsewhere: left fused
            self.other = self.qkv

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.hd, self.kv * self.hd, self.kv * self.hd], -1)
        q = q.view(b, s, self.heads, self.hd).transpose(1, 2)
        k = k.view(b, s, self.kv, self.hd).transpose(1, 2).repeat_interleave(self.heads // self.kv, 1)
        v = v.view(b, s, self.kv, self.hd).transpose(1, 2).repeat_interleave(self.heads // self.kv, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        x = x + self.down(F.silu(gate) * up)
        return F.cross_entropy(self.head(x).flatten(0, 1), y.flatten())


def _example(**kw) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = FusedBlock(**kw).double()
    return model, (torch.randn(4, 8, 32, dtype=torch.float64), torch.randint(0, 16, (4, 8)))


def _parts(graph) -> dict[str, tuple]:
    return {v.target: v.part for v in graph.params() if v.part is not None}


def test_a_fused_projection_becomes_one_per_part_and_computes_the_same() -> None:
    model, inputs = _example()
    graph = torchweave.capture(model, inputs)
    assert _parts(graph) == {
        "qkv.weight[0:32]": ("qkv.weight", 0, 0), "qkv.weight[32:48]": ("qkv.weight", 0, 32),
        "qkv.weight[48:64]": ("qkv.weight", 0, 48), "qkv.bias[0:32]": ("qkv.bias", 0, 0),
        "qkv.bias[32:48]": ("qkv.bias", 0, 32), "qkv.bias[48:64]": ("qkv.bias", 0, 48),
        "gate_up.weight[0:64]": ("gate_up.weight", 0, 0),
        "gate_up.weight[64:128]": ("gate_up.weight", 0, 64)}
    assert not any(n.target in ("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default")
                   for n in graph.nodes)
    assert graph.num_params() == sum(p.numel() for p in model.parameters())
    state = model_state(model, graph)
    (loss,) = run_graph(graph, state, inputs)
    torch.testing.assert_close(loss, model(*inputs), rtol=1e-12, atol=0)  # the same dot products
    whole = join_parts(graph, {v.target: param_tensor(state, v) for v in graph.params()})
    assert whole.keys() == dict(model.named_parameters()).keys()
    assert all(torch.equal(whole[k], p) for k, p in model.named_parameters())


@pytest.mark.parametrize("name", ["fused", "hf-gpt2-tiny", "hf-phi3-tiny"])
def test_tensor_parallelism_splits_a_fused_attention_by_heads(name: str) -> None:
    if name == "fused":
        model, inputs = _example()
    else:
        pytest.importorskip("transformers")
        model, inputs = built(name)[:2]
    graph = torchweave.capture(model, inputs)
    plan = resolve("tp", graph, 2)
    attention = [n for n in graph.nodes if "scaled_dot_product_attention" in n.target]
    assert attention
    for node in attention:  # split by heads, not run whole on both devices (R×2)
        (t,) = plan.trans[node.name]
        assert t.dim is not None and t.parts == 2, (node.name, t)
        assert node.annotation.split(" -> ")[1].split()[1] == t.dim  # the head dim
    projections = [n for n in graph.nodes if any(graph.values[r.name].part for r in n.input_refs())]
    assert projections and all(plan.trans[n.name][0].dim is not None for n in projections)


def test_left_fused_where_the_rewrite_would_not_be_exact() -> None:
    model, inputs = _example(tied=True)  # the weight has a second name
    assert not _parts(torchweave.capture(model, inputs)).keys() & {"qkv.weight[0:32]"}

    class Overlap(nn.Module):  # cuts that overlap, and the fused output read whole too
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.Linear(8, 12)

        def forward(self, x):
            y = self.p(x)
            return (y[..., :8] * y[..., 4:]).sum() + y[..., 0:6].sum() * y.mean()

    assert not _parts(torchweave.capture(Overlap(), (torch.randn(2, 8),)))

    class Odd(nn.Module):  # each left fused, and each still captures and computes right
        def __init__(self, case: str) -> None:
            super().__init__()
            self.case, self.p, self.w = case, nn.Linear(8, 12), nn.Parameter(torch.randn(12, 12))

        def forward(self, x):
            if self.case == "unread":  # c's rows would get no gradient as a part of their own
                a, b, c = self.p(x).split(4, -1)
                return (a * b).sum()
            if self.case == "output":  # a value between the projection and its cuts is returned
                y = self.p(x)
                a, b = y.view(2, 1, 12).split(6, -1)
                return (a * b).sum(), y
            a, b = F.linear(self.w, self.w).split([4, 8], -1)  # the weight is its input too
            return a.sum() + b.pow(2).sum()

    for case in ("unread", "output", "self"):
        model, x = Odd(case), torch.randn(2, 8)
        graph = torchweave.capture(model, (x,))
        assert not _parts(graph), case
        got = run_graph(graph, model_state(model, graph), (x,))
        want = model(x)
        torch.testing.assert_close(got[0], want[0] if isinstance(want, tuple) else want)


def test_new_names_never_take_an_existing_one() -> None:
    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.Linear(8, 12)
            self.register_parameter("weight_part0", nn.Parameter(torch.randn(3)))

        def forward(self, linear_part4):  # an input named like a new value
            a, b = self.p(linear_part4).split([4, 8], -1)
            return a.sum() * b.mean() + self.weight_part0.sum()

    model, x = Named(), torch.randn(2, 8)
    graph = torchweave.capture(model, (x,))
    assert len(_parts(graph)) == 4
    (got,) = run_graph(graph, model_state(model, graph), (x,))
    torch.testing.assert_close(got, model(x))


def test_a_graph_file_keeps_parts_and_refuses_a_changed_one() -> None:
    model, inputs = _example()
    graph = torchweave.capture(model, inputs)
    text = graph_to_json(graph)
    assert _parts(graph_from_json(text)) == _parts(graph)
    data = json.loads(text)
    name = next(k for k, v in data["values"].items() if v.get("part") == ["qkv.weight", 0, 32])
    for key, bad, said in [("target", "__import__('os').system('x')", "names its module tensor"),
                           ("part", ["qkv.weight", 0, 33], "end to end"),
                           ("part", ["qkv.weight", 7, 32], "a dim of its shape"),
                           ("part", "qkv.weight", "[module path, dim, start]"),
                           ("part", ["", 0, 32], "a module path"),
                           ("part", ["out.weight", 0, 0], "held whole or as parts"),
                           ("shape", [16, 31], "agree on the other dims"),
                           ("shape", [0, 32], "not empty"),
                           ("aliases", ["x.weight"], "none on a part")]:
        changed = json.loads(text)
        changed["values"][name][key] = bad
        with pytest.raises(TorchweaveError, match=said.replace("[", r"\[")):
            graph_from_json(json.dumps(changed))


def test_exported_pieces_of_parts_land_in_the_module_tensor(tmp_path) -> None:
    from safetensors.torch import load_file

    from torchweave.train.export import export_safetensors, model_layout

    model, inputs = _example()
    graph = torchweave.capture(model, inputs)
    state = model_state(model, graph)
    parts = _parts(graph)
    halves = [{}, {}]  # two ranks, each with the rows of half the heads of every part
    for v in graph.params():
        t = param_tensor(state, v)
        cut = t.shape[0] // 2
        for r in (0, 1):
            box = tuple((cut * r, cut * (r + 1)) if i == 0 else (0, n) for i, n in enumerate(t.shape))
            halves[r][v.target] = (box, t[cut * r: cut * (r + 1)])
    shapes, aliases = model_layout(graph, model.state_dict().keys())
    assert shapes["qkv.weight"] == (64, 32) and "qkv.weight[0:32]" not in shapes
    written = export_safetensors(halves, shapes, tmp_path / "m.safetensors", aliases=aliases, parts=parts)
    fresh = FusedBlock().double()
    fresh.load_state_dict(load_file(str(tmp_path / "m.safetensors")), strict=True)
    assert all(torch.equal(written[k], p) and torch.equal(fresh.state_dict()[k], p)
               for k, p in model.state_dict().items())


def test_a_hostile_parameter_name_stays_data_in_a_parts_target_and_the_code(tmp_path) -> None:
    """A parameter named like code (torch refuses only dots) reaches generated code through
    a part's target as a string literal, never as a statement."""
    import ast

    from torchweave.codegen.render import write
    from torchweave.lower.lower import lower

    name = "w')\nimport os  #"

    class Hostile(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Module()
            self.lin.register_parameter(name, nn.Parameter(torch.randn(12, 8)))

        def forward(self, x):
            a, b = F.linear(x, getattr(self.lin, name)).split([4, 8], -1)
            return a.sum() * b.mean()

    model, x = Hostile(), torch.randn(2, 8)
    graph = torchweave.capture(model, (x,))
    assert sorted(_parts(graph)) == [f"lin.{name}[0:4]", f"lin.{name}[4:12]"]
    for path in write(lower(graph, resolve("tp", graph, 2)), str(tmp_path)):
        tree = ast.parse(open(path).read())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert "os" not in imported
