"""``plan: auto`` and ``split=solved`` price "this machine": the GPU torch reports, matched
to the device catalog by whole words (``torchweave.search.local_device``), or the CPU."""

from __future__ import annotations

import pytest
import torch


def test_this_machine_is_priced_as_its_own_gpu(monkeypatch) -> None:
    """``plan: auto`` and ``split=solved`` on a GPU machine price the GPU torch reports, not an
    H100 whatever it is; a GPU the catalog lacks is priced as an H100 with a warning."""
    from torchweave.search import local_cluster, local_device
    from torchweave.sim.hardware.devices import GiB, gpu_entry

    assert gpu_entry("NVIDIA H200", 141 * GiB) == "H200-141GB-SXM"
    assert gpu_entry("NVIDIA A100-SXM4-80GB", 80 * GiB) == "A100-80GB-SXM"
    assert gpu_entry("NVIDIA A100-SXM4-40GB", 40 * GiB) == "A100-40GB-SXM"
    assert gpu_entry("NVIDIA A100 80GB PCIe", 80 * GiB) == "A100-80GB-PCIe"
    assert gpu_entry("NVIDIA GeForce RTX 3090", 24 * GiB) == "RTX3090"
    assert gpu_entry("NVIDIA H100 80GB HBM3", 80 * GiB) == "H100-80GB-SXM"
    assert gpu_entry("Tesla V100-SXM2-32GB", 32 * GiB) == "V100-32GB-SXM2"
    assert gpu_entry("AMD Instinct MI250X / MI250", 64 * GiB) == "MI250"
    for other in ("NVIDIA L4", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA GH200 480GB",
                  "Tesla V100-PCIE-16GB", "NVIDIA A100-PCIE-40GB", "NVIDIA A100-SXM4-80GB MIG 1g.10gb"):
        assert gpu_entry(other, 40 * GiB) is None, other  # not an entry the catalog has

    class Props:
        total_memory = 141 * GiB

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    assert local_device().name == "H200-141GB-SXM"
    assert local_cluster(8).device.name == "H200-141GB-SXM"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H100 PCIe")
    Props.total_memory = 80 * GiB - 1
    with pytest.warns(UserWarning, match="'NVIDIA H100 PCIe' is not in the device catalog"):
        dev = local_device()
    assert dev.name == "H100-80GB-SXM" and dev.memory_bytes == 80 * GiB - 1  # its own memory
