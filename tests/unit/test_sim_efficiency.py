"""Each GPU's efficiency factors: published measurements, cited in the catalog, and a
cluster YAML's own (docs/simulator.md, "Cost model")."""

from __future__ import annotations

import pytest

from torchweave.errors import SimError
from torchweave.sim import CATALOG, ComputeModel, load_cluster_yaml

REQUIRED = ["V100-32GB-SXM2", "A100-40GB-SXM", "A100-80GB-SXM", "A100-80GB-PCIe", "H100-80GB-SXM",
            "H200-141GB-SXM", "RTX3090", "RTX3090-NVLink", "RTX4090", "MI250"]


@pytest.mark.parametrize("name", REQUIRED)
def test_each_gpu_cites_where_its_efficiencies_come_from(name: str) -> None:
    d = CATALOG[name]
    assert 0.5 < d.matmul_efficiency < 1 and 0.5 < d.bandwidth_efficiency < 1
    cited = " ".join(d.sources)
    assert "matmul" in cited and "bandwidth" in cited, d.sources
    assert ComputeModel.for_device(d) == ComputeModel(matmul=d.matmul_efficiency,
                                                      bandwidth=d.bandwidth_efficiency)


def test_published_efficiencies() -> None:
    # The measured rows they come from (docs/simulator.md, "Cost model"); none is fitted.
    a100 = CATALOG["A100-80GB-SXM"]
    assert a100.matmul_efficiency == pytest.approx(271.2 / 312, abs=1e-3)
    assert a100.bandwidth_efficiency == pytest.approx(1724.8 / 2039, abs=1e-3)
    assert CATALOG["A100-40GB-SXM"].bandwidth_efficiency == pytest.approx(1377.4 / 1555, abs=1e-3)
    assert CATALOG["H100-80GB-SXM"].matmul_efficiency == pytest.approx(794.5 / 989, abs=1e-3)
    assert CATALOG["A100-80GB-PCIe"].matmul_efficiency == pytest.approx(252.9 / 312, abs=1e-3)


def test_a_cluster_yaml_sets_its_own_efficiencies(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("device: {base: A100-80GB-SXM, name: ours, matmul_efficiency: 0.7}\nnodes: 1\n")
    c = load_cluster_yaml(path)
    assert ComputeModel.for_device(c.device).matmul == 0.7
    assert c.device.bandwidth_efficiency == CATALOG["A100-80GB-SXM"].bandwidth_efficiency
    path.write_text("device: {base: A100-80GB-SXM, matmul_efficiency: 1.2, "
                    "bandwidth_efficiency: 0}\nnodes: 1\n")
    with pytest.raises(SimError) as err:
        load_cluster_yaml(path)
    objs = [p.obj for p in err.value.problems]
    assert "device A100-80GB-SXM.matmul_efficiency" in objs, objs
    assert "device A100-80GB-SXM.bandwidth_efficiency" in objs, objs
    assert "in (0, 1]" in str(err.value)
