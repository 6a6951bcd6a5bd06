"""The small device options that let the GPU check (bench/gpu_check.py) run the
single-process parts on CUDA: ``run_node``/``run_graph(device=...)`` and
``LaunchConfig(device=...)``. Checked here without a GPU, on the meta device."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import built, captured, state_of
from torchweave.ir import run_graph, run_node
from torchweave.ir.interp import substitute
from torchweave.runtime.launch import LaunchConfig, LaunchError, spawn


def test_ops_that_make_tensors_make_them_on_the_given_device() -> None:
    graph = captured("gpt-tiny")
    model, inputs = built("gpt-tiny")[:2]
    (node,) = [n for n in graph.nodes if n.target == "aten.arange.default"]
    assert torch.device("cpu") in substitute(node.kwargs, {}).values()  # captured on the CPU
    for device, want in ((None, "cpu"), (torch.device("meta"), "meta")):
        env: dict[str, torch.Tensor] = {}
        run_node(node, env, device)
        assert env[node.outputs[0]].device.type == want
    meta = torch.device("meta")
    state = {k: v.detach().to(meta) for k, v in state_of(model).items()}
    outs = run_graph(graph, state, tuple(x.to(meta) for x in inputs), device=meta)
    assert all(o.device == meta for o in outs)


def test_launch_device_is_validated_and_resolved() -> None:
    with pytest.raises(LaunchError) as info:
        LaunchConfig(world_size=1, backend="nccl", device="cpu")
    assert "LaunchConfig.device" in str(info.value) and "nccl communicates CUDA tensors" in str(info.value)
    with pytest.raises(LaunchError, match="LaunchConfig.device"):
        LaunchConfig(world_size=1, device="tpu")  # type: ignore[arg-type]
    cpu = LaunchConfig(world_size=2, backend="auto", device="cpu")
    assert cpu.resolved_backend() == "gloo" and cpu.resolved_device(1) == torch.device("cpu")
    assert LaunchConfig(world_size=2, backend="gloo").resolved_device(1) == torch.device("cpu")


def test_cuda_tensors_without_a_gpu_fail_before_launch() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the launch would go ahead")
    with pytest.raises(LaunchError, match="CUDA tensors need a visible GPU"):
        spawn(print, LaunchConfig(world_size=1, backend="gloo", device="cuda"))
