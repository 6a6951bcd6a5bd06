"""Capture: graphs that replay exactly, keep names and sources, and fail clearly."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchweave
from tests.conftest import TINY, built, captured, state_of
from torchweave.errors import CaptureError
from torchweave.ir import check_graph, run_graph


@pytest.mark.parametrize("name", TINY)
def test_replay_matches_eager_loss_and_grads(name: str) -> None:
    model, inputs = built(name)[:2]
    graph = captured(name)
    check_graph(graph)
    assert graph.loss is not None
    model.zero_grad()
    loss = model(*inputs)
    loss.backward()
    want = {p: t.grad.clone() for p, t in model.named_parameters()}
    state = {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in state_of(model).items()}
    outs = run_graph(graph, state, inputs)
    got_loss = outs[graph.outputs.index(graph.loss)]
    torch.testing.assert_close(got_loss, loss.detach(), rtol=1e-5, atol=1e-6)
    got_loss.backward()
    for path in {v.part[0] if v.part else v.target for v in graph.params()}:  # parts: their tensor
        torch.testing.assert_close(state[path].grad, want[path], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, p=path: f"grad of {p}: {m}")


@pytest.mark.parametrize("name", TINY)
def test_every_tensor_has_meta_and_every_node_a_user_source(name: str) -> None:
    graph = captured(name)
    for node in graph.nodes:
        assert node.source, f"{node.name} ({node.target}) has no source line"
        file, _, line = node.source.rpartition(":")
        assert line.isdigit() and "site-packages/torch/" not in file
        for out in node.outputs:
            meta = graph.values[out].meta
            assert isinstance(meta.shape, tuple) and isinstance(meta.dtype, torch.dtype)
        assert node.annotation, f"{node.name} has no annotation"


def test_param_paths_and_tied_weights() -> None:
    model, _ = built("gpt-tiny")[:2]
    graph = captured("gpt-tiny")
    paths = {v.target for v in graph.params()}
    expected = {p for p, _ in model.named_parameters()}  # named_parameters dedupes ties
    assert paths == expected
    tied = [v for v in graph.params() if v.aliases]
    assert len(tied) == 1 and "lm_head.weight" in tied[0].aliases[0] + tied[0].target
    assert graph.num_params() == sum(p.numel() for p in model.parameters())
    modules = {n.module for n in graph.nodes}
    assert any(m.startswith("blocks.1.") for m in modules), sorted(modules)[:10]


def test_hf_paths_keep_module_names() -> None:
    pytest.importorskip("transformers")
    graph = captured("hf-llama-tiny")
    paths = {v.target for v in graph.params()}
    assert "model.model.layers.0.self_attn.q_proj.weight" in paths


def test_meta_capture_matches_real_capture() -> None:
    from torchweave.models import FACTORIES

    torch.manual_seed(0)
    with torch.device("meta"):
        model, inputs = FACTORIES["llama-tiny"]()
    assert all(p.is_meta for p in model.parameters())
    meta_graph = torchweave.capture(model, inputs)
    real_graph = captured("llama-tiny")
    assert [n.target for n in meta_graph.nodes] == [n.target for n in real_graph.nodes]
    assert [n.annotation for n in meta_graph.nodes] == [n.annotation for n in real_graph.nodes]


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:  # a branch on data
            h = h * 2
        return h.sum()


def test_data_dependent_branch_names_the_line() -> None:
    with pytest.raises(CaptureError) as info:
        torchweave.capture(_Branchy(), (torch.randn(2, 4),))
    msg = str(info.value)
    assert f"{os.path.basename(__file__)}:" in msg
    assert "if h.sum() > 0" in msg
    assert "torch.where" in msg


def test_numpy_in_forward_is_reported_with_the_line(tmp_path) -> None:
    src = tmp_path / "np_model.py"
    src.write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.randn(4))
            def forward(self, x):
                y = torch.from_numpy((x * self.w).detach().numpy())
                return y.sum()
        def factory():
            return M(), (torch.randn(2, 4),)
    """))
    from torchweave.factory import load

    loaded = load(f"{src}:factory")
    with pytest.raises(CaptureError) as info:
        torchweave.capture(loaded.model, loaded.args)
    assert "np_model.py:8" in str(info.value)


def test_wrong_arity_names_the_arguments() -> None:
    model, inputs = built("gpt-tiny")[:2]
    with pytest.raises(CaptureError) as info:
        torchweave.capture(model, inputs + (inputs[0],))
    msg = str(info.value)
    assert "forward(idx, targets)" in msg and "3 positional" in msg


def test_wrong_dtype_names_the_argument_and_line() -> None:
    model, (idx, targets) = built("gpt-tiny")[:2]
    with pytest.raises(CaptureError) as info:
        torchweave.capture(model, (idx.float(), targets))
    msg = str(info.value)
    assert "idx=float32[4, 16]" in msg
    assert "gpt.py:" in msg


def test_float_embedding_indices_are_refused_where_export_traces_them() -> None:
    """Some torch releases' export traces an embedding of float indices (2.11); capture then
    refuses it itself, naming the inputs and the line. Here export raises first (2.13), so
    the check is run on a program whose indices are made float after export."""
    from torchweave.capture.export import _check_lookups

    class Lookup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Embedding(10, 4)

        def forward(self, idx):
            return self.table(idx).sum()

    model, idx = Lookup(), torch.zeros(2, 3, dtype=torch.long)
    ep = torch.export.export(model, (idx,), strict=False)
    _check_lookups(ep, model, ["idx"], (idx,), {})  # integer indices pass
    node = next(n for n in ep.graph.nodes if str(n.target) == "aten.embedding.default")
    node.args[1].meta["val"] = node.args[1].meta["val"].float()
    with pytest.raises(CaptureError) as info:
        _check_lookups(ep, model, ["idx"], (idx.float(),), {})
    msg = str(info.value)
    assert "idx=float32[2, 3]" in msg and "torch.long" in msg and "test_capture.py:" in msg


def test_inputs_must_be_a_tuple() -> None:
    model, (idx, _) = built("gpt-tiny")[:2]
    with pytest.raises(CaptureError, match="tuple"):
        torchweave.capture(model, [idx])  # type: ignore[arg-type]


def test_loss_rewrites_are_exact_with_ignored_targets() -> None:
    """Mean cross-entropy becomes sum / count; ignored targets are not counted."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 16)

        def forward(self, x, y):
            return F.cross_entropy(self.lin(x), y)

    torch.manual_seed(0)
    m, x = M(), torch.randn(8, 8)
    y = torch.tensor([1, -100, 3, 4, -100, 6, 7, 8])
    graph = torchweave.capture(m, (x, y))
    targets = [n.target for n in graph.nodes]
    assert "aten.ne.Scalar" in targets and targets[-1] == "aten.div.Tensor"
    assert targets.count("aten.linear.default") == 1 and "aten.add.Tensor" in targets
    (got,) = run_graph(graph, state_of(m), (x, y))
    torch.testing.assert_close(got, m(x, y))


def test_a_model_that_offers_a_kv_cache_is_captured_without_one() -> None:
    """A transformers decoder with ``use_cache=True`` (its default) concatenated onto an
    empty cache, which failed the cat annotation and replicated; capture turns the cache
    off for its trace only."""
    import warnings

    pytest.importorskip("transformers")
    from torchweave.models.hf import hf_llama

    model = hf_llama()
    model.model.config.use_cache = True
    x = torch.randint(0, 256, (2, 16))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        graph = torchweave.capture(model, (x, x))
    assert not [str(w.message) for w in seen if "annotation" in str(w.message)]
    assert all(m.numel > 0 for v in graph.values.values() if (m := v.meta) is not None)
    assert model.model.config.use_cache is True  # left as it was
