"""Generated code calls the fused ``linear(x, w, b)`` / ``addmm`` wherever the plan allows."""

from __future__ import annotations

import copy
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from tests.conftest import built, captured
from torchweave.codegen.fuse import fuse_bias, fuse_cross_entropy
from torchweave.codegen.render import render
from torchweave.lower.lower import lower
from torchweave.lower.program import Compute, Free, LocalRef
from torchweave.lower.stages import reads
from torchweave.parallel import compile_plan
from torchweave.policies import resolve
from torchweave.runtime.executor import RankModule
from torchweave.runtime.groups import GroupCache

FUSED = re.compile(r"= aten\.linear\.default\([^,]+, [^,]+, [^,)]+\)")


def _biased_linears(graph) -> int:
    return sum(1 for n in graph.nodes if n.name.endswith("_nobias"))


def _no_use_after_del(instrs) -> None:
    freed: set[str] = set()
    for ins in instrs:
        assert not freed & set(reads(ins)), f"{ins} reads a deleted name"
        if isinstance(ins, Free):
            freed |= set(ins.names)


def test_data_parallel_fuses_every_bias() -> None:
    graph = captured("gpt-tiny")
    prog = lower(graph, resolve("dp", graph, 2))[0]
    src = render(prog)
    assert "_nobias" not in src
    assert len(FUSED.findall(src)) == _biased_linears(graph) > 0
    fused = fuse_bias(prog, prog.instrs, {prog.loss or ""})
    _no_use_after_del(fused)
    assert len(fused) < len(prog.instrs)
    assert not any(isinstance(i, Free) and not i.names for i in fused)


def test_a_split_contraction_keeps_its_add_after_the_sum() -> None:
    """Row-parallel linears (attention out, MLP out) sum their pieces before the bias: no fusion there."""
    graph = captured("gpt-tiny")
    prog = lower(graph, resolve("tp", graph, 2))[0]
    src = render(prog).splitlines()
    kept = [i for i, line in enumerate(src) if re.search(r"= aten\.add\.Tensor\(\w+_nobias_all_reduce", line)]
    assert kept, "the row-parallel bias add stays a separate line"
    for i in kept:
        assert "C.all_reduce" in "\n".join(src[max(0, i - 3):i])
    assert 0 < len(FUSED.findall("\n".join(src))) < _biased_linears(graph)


def test_fusion_stays_inside_one_recompute_group() -> None:
    graph = captured("gpt-tiny")
    plan = resolve("dp:recompute=full", graph, 1)
    prog = lower(graph, plan)[0]
    src = render(prog)
    assert "torch.utils.checkpoint.checkpoint" in src and FUSED.search(src)
    # a group holding the product but not its add: the pair stays apart
    first = next(n.name for n in graph.nodes if n.name.endswith("_nobias"))
    prog.recompute = [(first,)]
    fused = fuse_bias(prog, prog.instrs, {prog.loss or ""})
    assert any(isinstance(i, Compute) and i.node == first for i in fused)


class _AddmmNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 6))
        self.b = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.b, x, self.w).tanh().sum()


@pytest.mark.parametrize("name", ["gpt-tiny", "addmm"])
def test_fused_code_gives_the_one_device_loss_and_gradients(tmp_path: Path, name: str) -> None:
    if name == "addmm":
        torch.manual_seed(0)
        model, inputs = _AddmmNet(), (torch.randn(4, 8),)
    else:
        model, inputs = built(name)[:2]
    model = copy.deepcopy(model).double()
    inputs = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    compiled = compile_plan(model, inputs, "dp", world_size=1, code_dir=str(tmp_path))
    src = Path(compiled.code_paths[0]).read_text()
    assert ("aten.addmm.default(" in src) if name == "addmm" else FUSED.search(src)
    _matches_one_device(compiled, model, inputs)


def _matches_one_device(compiled, model: nn.Module, inputs: tuple) -> None:
    """One step of the compiled rank-0 program: the model's loss and gradients (float64)."""
    group_cache = GroupCache(rank=0, world_size=1, timeout_s=5.0, device=torch.device("cpu"))
    module = RankModule(compiled.programs[0], compiled.code_paths[0], compiled.state, group_cache)
    loss = module.backward_step(*inputs)
    ref = model(*inputs)
    ref.backward()
    assert abs(loss - float(ref.detach())) < 1e-12
    grads = module.grad_pieces()
    for path, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[path][1], p.grad, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- cross-entropy
CE_FUSED = re.compile(r"= aten\.cross_entropy_loss\.default\((\w+), (\w+), None, 2, -100\)")


def test_data_parallel_writes_the_cross_entropy_as_one_call() -> None:
    """dp: each rank's rows run the nine captured ops alone: one fused call, at the sum's
    place, the logits and targets freed after it; the Program keeps the nine nodes."""
    graph = captured("gpt-tiny")
    prog = lower(graph, resolve("dp", graph, 2))[0]
    src = render(prog)
    assert len(CE_FUSED.findall(src)) == 1
    assert "logsumexp" not in src and "aten.gather" not in src
    assert any(isinstance(i, Compute) and i.fn == "aten.logsumexp.default" for i in prog.instrs)
    keep = {prog.loss or ""}
    fused = fuse_cross_entropy(prog, fuse_bias(prog, prog.instrs, keep), keep)
    _no_use_after_del(fused)
    assert not any(isinstance(i, Free) and not i.names for i in fused)
    call = next(i for i in fused if isinstance(i, Compute) and i.fn == "aten.cross_entropy_loss.default")
    x, t = call.args[0].name, call.args[1].name
    after = fused[fused.index(call) + 1:]
    assert any(isinstance(i, Free) and {x, t} <= set(i.names) for i in after)


def test_split_classes_keep_the_nine_ops() -> None:
    """tp splits the vocabulary: the logsumexp and the picked logit meet sums over ranks
    between the ops, so nothing is fused."""
    graph = captured("gpt-tiny")
    prog = lower(graph, resolve("tp", graph, 2))[0]
    src = render(prog)
    assert not CE_FUSED.search(src) and "logsumexp" in src


def test_a_chain_value_read_elsewhere_keeps_the_chain() -> None:
    """A value of the chain that something else reads (here: kept as an output) stops the
    fusion; a target count reading the mask keeps the mask and fuses the rest."""
    graph = captured("gpt-tiny")
    prog = lower(graph, resolve("dp", graph, 2))[0]
    lse = next(i.outputs[0] for i in prog.instrs if isinstance(i, Compute)
               and i.fn == "aten.logsumexp.default")
    kept = fuse_cross_entropy(prog, prog.instrs, {prog.loss or "", lse})
    assert not any(isinstance(i, Compute) and i.fn == "aten.cross_entropy_loss.default" for i in kept)
    # the mask read by one more op (a count): it stays, computed before the fused call
    valid = next(i for i in prog.instrs if isinstance(i, Compute) and i.node.endswith("_valid"))
    extra = replace(valid, node="count_of_mask", fn="aten.sum.default",
                    args=(LocalRef(valid.outputs[0]),), kwargs={}, outputs=("count_of_mask",))
    kept_at = next(k for k, i in enumerate(prog.instrs) if isinstance(i, Compute)
                   and i.node.endswith("_kept"))  # before the mask's del
    instrs = prog.instrs[:kept_at + 1] + [extra] + prog.instrs[kept_at + 1:]
    _no_use_after_del(instrs)
    fused = fuse_cross_entropy(prog, instrs, {prog.loss or "", "count_of_mask"})
    names = [i.node for i in fused if isinstance(i, Compute)]
    assert valid.node in names and "count_of_mask" in names
    assert any(isinstance(i, Compute) and i.fn == "aten.cross_entropy_loss.default" for i in fused)
    _no_use_after_del(fused)


@pytest.mark.parametrize("plan", ["dp", "dp:recompute=full"])
def test_fused_cross_entropy_gives_the_one_device_loss_and_gradients(tmp_path: Path, plan: str) -> None:
    """Logits with a target ignored (-100): the fused call keeps ``ignore_index``."""
    model, (idx, tgt) = built("gpt-tiny")[:2]
    model = copy.deepcopy(model).double()
    tgt = tgt.clone()
    tgt[0, :3] = -100
    compiled = compile_plan(model, (idx, tgt), plan, world_size=1, code_dir=str(tmp_path))
    src = Path(compiled.code_paths[0]).read_text()
    assert CE_FUSED.search(src), src[-2000:]
    _matches_one_device(compiled, model, (idx, tgt))


class _Losses(nn.Module):
    """A mean and a sum cross-entropy over one head, and one with class probabilities."""

    def __init__(self, soft: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head, self.soft = nn.Linear(8, 10), soft

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        y = self.head(x)
        if self.soft:
            return nn.functional.cross_entropy(y, t)
        return nn.functional.cross_entropy(y, t) + 0.5 * nn.functional.cross_entropy(
            y * 2, t, reduction="sum", ignore_index=3)


def test_a_summed_cross_entropy_fuses_too(tmp_path: Path) -> None:
    """reduction="sum": the loss's own node is the chain's sum; two chains in one program."""
    model = _Losses().double()
    inputs = (torch.randn(6, 8, dtype=torch.float64), torch.tensor([1, 3, 7, 9, 3, 0]))
    compiled = compile_plan(model, inputs, "dp", world_size=1, code_dir=str(tmp_path))
    src = Path(compiled.code_paths[0]).read_text()
    assert src.count("aten.cross_entropy_loss.default(") == 2 and "logsumexp" not in src
    assert ", None, 2, 3)" in src
    _matches_one_device(compiled, model, inputs)


def test_class_probabilities_are_not_rewritten(tmp_path: Path) -> None:
    """Soft targets ([n, classes] floats) are not class indices: capture keeps the call as
    written, which gives the model's own loss (the index form counted n·classes targets)."""
    model = _Losses(soft=True).double()
    inputs = (torch.randn(6, 8, dtype=torch.float64),
              torch.softmax(torch.randn(6, 10, dtype=torch.float64), dim=1))
    compiled = compile_plan(model, inputs, "dp", world_size=1, code_dir=str(tmp_path))
    assert not any(n.name.endswith("_lse") for n in compiled.graph.nodes)
    _matches_one_device(compiled, model, inputs)
