"""Co-shard on one device: same numbers, and the region's peak memory falls by about (k-1)/k."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import assert_grads_match_model, built, captured, state_of
from torchweave.api import capture
from torchweave.codegen.render import render, write
from torchweave.errors import TorchweaveError
from torchweave.lower.lower import lower
from torchweave.plan.plan import Plan
from torchweave.policies import resolve
from torchweave.policies.coshard import with_coshard, with_coshard_spec
from torchweave.runtime.executor import RankModule
from torchweave.runtime.groups import GroupCache


class PeakMemory(TorchDispatchMode):
    """Peak bytes of the storages made by ops (forward and backward) alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.live[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


class MLP(nn.Module):
    """One wide MLP: its hidden activation is most of the step's memory."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 4096), nn.Linear(4096, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x))).pow(2).mean()


def _module(graph, plan, state, tmp_path, tag: str) -> RankModule:
    programs = lower(graph, plan)
    (path,) = write(programs, str(tmp_path / tag))
    group_cache = GroupCache(rank=0, world_size=1, timeout_s=5.0, device=torch.device("cpu"))
    return RankModule(programs[0], path, state, group_cache)


def test_coshard_region_memory_falls_by_k_minus_1_over_k(tmp_path) -> None:
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 128, 64)
    graph = capture(model, (x,))
    chain = [n.name for n in graph.nodes[:4]]  # fc1 (matmul, bias), gelu, fc2's matmul
    state = {k: v.detach() for k, v in model.state_dict().items()}
    peaks, losses, grads = {}, {}, {}
    for k in (1, 2, 4):
        plan = resolve("dp", graph, 1)
        if k > 1:
            with_coshard(plan, graph, chain, k, "n")
            assert Plan.from_json(plan.to_json()) == plan
        module = _module(graph, plan, state, tmp_path, f"k{k}")
        module.backward_step(x)  # warm up: the optimizer is not stepped, grads are reset
        for p in module.params.values():
            p.grad = None
        with PeakMemory() as pm:
            losses[k] = module.backward_step(x)
        peaks[k] = pm.peak
        grads[k] = {n: p.grad.clone() for n, p in module.params.items()}
    model.zero_grad()
    model(x).backward()
    for k in (1, 2, 4):
        assert abs(losses[k] - losses[1]) <= 1e-6 * abs(losses[1])
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[k][name], p.grad, rtol=1e-5, atol=1e-8)
    # peak(k) = rest + region / k: two measurements give the rest; the third is checked
    rest = 2 * peaks[2] - peaks[1]
    region = peaks[1] - rest
    drop = (peaks[1] - peaks[4]) / region
    assert region > 0.7 * peaks[1], peaks  # the region is most of the memory
    assert 0.65 <= drop <= 0.85, (drop, peaks)  # (k-1)/k = 0.75


def test_coshard_code_runs_each_piece_under_its_own_recompute(tmp_path) -> None:
    graph = captured("gpt-tiny")
    chain = [n.name for n in graph.nodes if n.module.startswith("blocks.0.mlp")][:4]
    plan = with_coshard(resolve("dp", graph, 1), graph, chain, 4, "n")
    src = render(lower(graph, plan)[0])
    assert src.count("torch.utils.checkpoint.checkpoint(_rc") == 4
    assert "co-shard region" in src and "co-shard: partial sums 0..3" in src
    model, inputs = built("gpt-tiny")[:2]
    state = {k: v.detach() for k, v in state_of(model).items()}
    module = _module(graph, plan, state, tmp_path, "gpt")
    assert_grads_match_model(module, model, inputs, module.backward_step(*inputs))


def test_bad_coshard_is_rejected_before_launch() -> None:
    graph = captured("gpt-tiny")
    with pytest.raises(TorchweaveError, match="splits 3 more ways .* evenly"):
        with_coshard(resolve("dp", graph, 1), graph, ["linear_4_nobias"], 3, "n")
    with pytest.raises(TorchweaveError, match="coshard is K"):
        with_coshard_spec(resolve("dp", graph, 1), graph, "attn:1")
    with pytest.raises(TorchweaveError, match="the model's modules"):
        with_coshard_spec(resolve("dp", graph, 1), graph, "nosuchmodule:2")
    plan = resolve("dp", graph, 2)  # a second split on one device per share: refused as a plan
    plan.split("linear_4_nobias", "n", 2).assign_all("linear_4_nobias", [0, 1, 0, 1])
    with pytest.raises(TorchweaveError, match="co-shard"):
        lower(graph, plan)


def test_a_coshard_that_reads_a_tied_weight_sums_its_gradient_as_the_plain_plan_does() -> None:
    """gpt-tiny's wte weight is read by the embedding (stage 0) and by lm_head (stage 1).
    Co-sharding lm_head must not hide that second reader from the parameter's planning: the
    gradient sum then waited for the bucketed sync that the other stage never joins, and
    every pipeline schedule hung (fuzzer seed 2204)."""
    from torchweave.lower.lower import Lowering
    from torchweave.plan.validate import validate
    from torchweave.policies.pipeline_policy import pipeline

    graph = captured("gpt-tiny")
    seen = {}
    for coshard in (False, True):
        plan = pipeline(graph, 2, schedule="gpipe", pp=2, micro=1)
        if coshard:
            with_coshard(plan, graph, ["linear_12"], 2, "n")
        validate(plan, graph)
        low = Lowering(graph, plan)
        low.run()
        # each stage keeps a copy, summed over both stages (lower/copies.py)
        seen[coshard] = (low.defer["p_wte_weight"], sorted(low.held["p_wte_weight"]),
                         low.param_grad["p_wte_weight"])
    assert seen[True] == seen[False] == (True, [0, 1], ((0, 1),))


@pytest.mark.parametrize("spec", ["dp:coshard=2", "dp:coshard=mlp:2", "dp:coshard=attn+mlp:4"])
def test_the_simulator_sees_what_coshard_keeps_and_reruns(spec, tmp_path) -> None:
    """The activations a co-shard saves, as the simulator predicts them, are what the
    generated code stops keeping (measured with saved-tensor hooks), and each chunk's
    forward is paid again; the fast paths agree with every rank simulated."""
    from tests.conftest import saved_bytes
    from torchweave.sim import simulate
    from torchweave.sim.hardware.cluster import parse_cluster

    model, inputs = built("gpt-tiny")[:2]
    graph = captured("gpt-tiny")
    state = {k: v.detach() for k, v in state_of(model).items()}
    measured, predicted, steps = {}, {}, {}
    for s in ("dp", spec):
        plan = resolve(s, graph, 1)
        measured[s] = saved_bytes(_module(graph, plan, state, tmp_path, s.replace(":", "_").replace("=", "_")
                                          .replace("+", "_")), inputs)
        res = simulate(graph, plan, parse_cluster("1xA100-80GB-SXM"), timeline=False)
        predicted[s], steps[s] = res.memory[0].activations, res.step_time
    assert measured[spec] < measured["dp"] and predicted[spec] < predicted["dp"]
    # co-shard adds no error of its own to the plain plan's (the attention core's saved
    # tensors, which co-sharding attention removes, are the plain plan's 5%)
    error = {s: abs(predicted[s] - measured[s]) for s in measured}
    assert error[spec] <= error["dp"] + 0.01 * measured[spec], (measured, predicted)
    assert steps[spec] > steps["dp"]  # the chunks' forward runs again
    big = resolve(spec, graph, 2)
    cluster = parse_cluster("2xA100-80GB-SXM@1")
    fast = simulate(graph, big, cluster, timeline=False)
    exact = simulate(graph, big, cluster, timeline=False, fold=False, symmetry=False)
    assert fast.step_time == pytest.approx(exact.step_time, rel=1e-9) and fast.memory == exact.memory
