"""Accelerators and links: frozen specs, and a built-in catalog.

Numbers come from the vendors' datasheets and whitepapers named in each entry's
``sources``. FLOP/s are *dense* (never the "with sparsity" figures). Memory and
link bandwidths are in bytes per second, decimal (1 GB/s = 1e9 B/s); memory
sizes are bytes. Where a number is not published (message latency, a typical
network, a price) it is an estimate, and the field's docstring says so.
``torchweave calibrate`` replaces estimates with measurements for the machine
at hand.
"""

from __future__ import annotations

import re
import types
from dataclasses import dataclass, fields
from typing import Literal, Mapping

from torchweave.errors import Problem, SimError

Precision = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]

GB = 1e9
GiB = 2**30
TFLOPS = 1e12


def positive_problems(where: str, obj: object, zero_ok: tuple[str, ...] = ()) -> list[Problem]:
    """A :class:`Problem` for each int/float field of ``obj`` that is not > 0 (not >= 0
    for the fields named in ``zero_ok``)."""
    out = []
    for f in fields(obj):  # type: ignore[arg-type]
        v = getattr(obj, f.name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not (
                v > 0 or (f.name in zero_ok and v == 0)):
            rule = "must be >= 0" if f.name in zero_ok else "must be > 0"
            sign = "non-negative" if f.name in zero_ok else "positive"
            out.append(Problem(obj=f"{where}.{f.name}", value=repr(v), rule=rule,
                               fix=f"give {f.name} a {sign} value"))
    return out


@dataclass(frozen=True, kw_only=True)
class Peak:
    """Peak dense FLOP/s per precision; ``None`` where the device has no such rate."""

    fp32: float
    """FP32 without TF32: matrix units where the device has FP32 ones (MI250),
    else the vector (CUDA-core) rate. Elementwise ops of any dtype use it too."""
    tf32: float | None = None
    """TF32 tensor-core rate (fp32 matmuls when TF32 is allowed)."""
    bf16: float | None = None
    """BF16 matrix rate with FP32 accumulation."""
    fp16: float | None = None
    """FP16 matrix rate with FP32 accumulation (what training uses; GeForce
    cards run FP16 accumulation at twice this)."""
    fp8: float | None = None
    """FP8 (E4M3/E5M2) matrix rate with FP32 accumulation."""

    def of(self, precision: Precision) -> float | None:
        return getattr(self, precision)


@dataclass(frozen=True, kw_only=True)
class Link:
    """One level of interconnect, as one device sees it (α-β model)."""

    bandwidth: float
    """Bytes/s per device, per direction. For a network: the node's NIC
    bandwidth divided by its devices."""
    latency: float
    """Seconds per message step (α), as a collective library sees it; an
    estimate unless measured."""
    kind: str = ""
    """What it is, in words: ``NVLink 3 (NVSwitch)``, ``8x200 Gb/s InfiniBand HDR``."""

    def __post_init__(self) -> None:
        problems = positive_problems("link", self)
        if problems:
            raise SimError(problems, header=f"bad link {self.kind or ''}".rstrip())


MAMF = ("S. Bekman, Machine Learning Engineering Open Book, 'Maximum Achievable Matmul FLOPS "
        "comparison table' (BF16 torch.mm, best shape of a sweep, mean of 100 iterations; "
        "github.com/stas00/ml-engineering, compute/accelerator/README.md, read 2026-12-08)")
"""The published measurement every GPU's ``matmul_efficiency`` comes from."""
BABELSTREAM = ("BabelStream Triad (T. Deakin, S. McIntosh-Smith et al., University of Bristol) as "
               "run and published by HPC sites: ALCF Polaris, A100-SXM4-40GB, 1,377 GB/s "
               "(argonne-lcf/ALCFBeginnersGuide, polaris/02_profiling.md); EPCC Tursa, "
               "A100-SXM4-80GB, 1,725 GB/s (Tursa BabelStream benchmark README)")
"""The published measurements every GPU's ``bandwidth_efficiency`` comes from."""
MATMUL_EFFICIENCY = 0.803
"""The median of the NVIDIA rows of :data:`MAMF` (86.9, 83.8, 81.1, 80.3, 78.6, 77.6, 72.9%
of peak): the matmul efficiency of a device that table has no row of."""
BANDWIDTH_EFFICIENCY = round((1377.4 / 1555 + 1724.8 / 2039) / 2, 3)
"""The mean of the two :data:`BABELSTREAM` fractions (0.886 and 0.846): the bandwidth
efficiency of a device without a measurement of its own."""


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator (or one CPU rank) and the node it typically sits in."""

    name: str
    """Catalog key: ``A100-80GB-SXM``."""
    description: str
    """What it is, in words."""
    peak: Peak
    """Peak dense FLOP/s per precision."""
    memory_bytes: int
    """Device memory, bytes."""
    memory_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    intra: Link
    """Link between devices of one node (per device, per direction)."""
    inter: Link
    """Network between nodes (per device, per direction); a typical one."""
    node_size: int
    """Devices in a typical node: the default of ``devices_per_node``."""
    price_per_hour: float
    """Typical on-demand cloud price per GPU-hour, USD, 2024–2025. An estimate:
    list prices vary by a factor of two or more between providers."""
    rates: Literal["datasheet", "measured"] = "datasheet"
    """``datasheet``: peaks, which real kernels reach only a fraction of (the
    cost model applies efficiency factors); ``measured``: rates already reached
    by real work (factors default to 1)."""
    sources: tuple[str, ...]
    """Where the numbers come from, by title."""
    matmul_efficiency: float = MATMUL_EFFICIENCY
    """Fraction of the matrix peak that large, well-shaped matmuls reach on this device,
    as measured and published (its source is in ``sources``). Default: the median of the
    NVIDIA rows of the measured table this comes from, for devices it has no row of
    (:data:`MATMUL_EFFICIENCY`). Ignored where ``rates`` is ``measured``."""
    bandwidth_efficiency: float = BANDWIDTH_EFFICIENCY
    """Fraction of the memory bandwidth a streaming kernel reaches on this device
    (BabelStream's Triad), as measured and published. Default: the mean of the two A100
    measurements found (:data:`BANDWIDTH_EFFICIENCY`). Ignored where ``rates`` is
    ``measured``."""
    comm_overlaps_compute: bool = True
    """Whether collectives run beside compute (a GPU's copy engines and NICs,
    NCCL's own SMs). ``False`` where they take the same core as compute (gloo on
    a CPU rank with one thread): the simulator then runs a rank's communication
    on its compute stream too, one after the other."""
    failures_per_hour: float = 419 / (16384 * 54 * 24)
    """The chance a device fails (stops the job) in one hour. Default: Llama 3's
    training, 419 unexpected interruptions in 54 days on 16,384 H100s (Dubey et al.,
    2024, "The Llama 3 Herd of Models", section 3.3.4), about 2e-5 per GPU-hour;
    state a cluster's own in its YAML (``device: {base: A100-80GB-SXM,
    failures_per_hour: ...}``)."""
    storage_write: float = 0.25e9
    """Bytes/s one device can write a checkpoint at, its share of the storage (an
    assumption: 2 GB/s per 8-device node; set it in the cluster YAML)."""
    cores: int | None = None
    """A CPU device: the cores of its node, where each rank is given one. A node
    running more ranks than that shares them: :class:`~torchweave.sim.hardware.cluster.Cluster`
    then gives each rank ``cores / ranks × shared_efficiency`` of the peak, the memory
    bandwidth and the bandwidth between ranks of the node (gloo's copies and sums run on
    those cores too), and ``shared_wait`` as its ``collective_wait``. ``None``: a device
    of its own per rank (a GPU)."""
    shared_efficiency: float = 1.0
    """Ranks outnumbering the cores: the fraction of its fair share (``cores / ranks``) of
    a core's rates that a rank reaches (time slicing, caches shared), as ``torchweave
    calibrate`` measures it with every rank computing at once."""
    shared_wait: float = 0.0
    """Ranks outnumbering the cores: seconds each collective waits for its last rank,
    which the scheduler has not yet run (ranks arrive out of step), as ``calibrate``
    measures it (:func:`~torchweave.sim.hardware.profile.profile_sync`)."""
    collective_wait: float = 0.0
    """Seconds added to every collective of more than one rank for ranks arriving out of
    step; 0 where each rank has its own device (ranks run in step), ``shared_wait`` on
    a node whose ranks share cores."""

    def __post_init__(self) -> None:
        where = f"device {self.name}"
        problems = positive_problems(where, self, zero_ok=("shared_wait", "collective_wait")) \
            + positive_problems(f"{where}.peak", self.peak)
        if not 0 < self.shared_efficiency <= 1:
            problems.append(Problem(obj=f"{where}.shared_efficiency",
                                    value=repr(self.shared_efficiency), rule="in (0, 1]",
                                    fix="measure it with torchweave calibrate, or leave 1"))
        for name in ("matmul_efficiency", "bandwidth_efficiency"):
            if getattr(self, name) > 1:  # (not > 0 is positive_problems')
                problems.append(Problem(obj=f"{where}.{name}", value=repr(getattr(self, name)),
                                        rule="a fraction of the peak, in (0, 1]",
                                        fix="give a measured fraction, e.g. 0.8"))
        if not self.sources:
            problems.append(Problem(obj=f"{where}.sources", value="()",
                                    rule="every device cites where its numbers come from",
                                    fix="add a datasheet title, or 'measured on <machine>, <date>'"))
        if problems:
            raise SimError(problems, header=f"bad device {self.name!r}")


# Links shared by several entries. Latencies are estimates of a collective
# library's per-step cost, not wire latencies.
_NVLINK2 = Link(bandwidth=150 * GB, latency=5e-6, kind="NVLink 2, 6 links (300 GB/s both directions)")
_NVLINK3 = Link(bandwidth=300 * GB, latency=5e-6, kind="NVLink 3 via NVSwitch (600 GB/s both directions)")
_NVLINK4 = Link(bandwidth=450 * GB, latency=5e-6, kind="NVLink 4 via NVSwitch (900 GB/s both directions)")
_PCIE4 = Link(bandwidth=31.5 * GB, latency=10e-6, kind="PCIe 4.0 x16 (16 GT/s x 16 lanes)")
_EDR_4X100 = Link(bandwidth=4 * 12.5 * GB / 8, latency=15e-6,
                  kind="4x100 Gb/s InfiniBand EDR per 8-GPU node (DGX-1)")
_HDR_8X200 = Link(bandwidth=25 * GB, latency=15e-6,
                  kind="8x200 Gb/s InfiniBand HDR per 8-GPU node, one NIC per GPU (DGX A100)")
_HDR_4X200 = Link(bandwidth=4 * 25 * GB / 8, latency=15e-6,
                  kind="4x200 Gb/s InfiniBand HDR per 8-GPU node (typical PCIe server)")
_NDR_8X400 = Link(bandwidth=50 * GB, latency=15e-6,
                  kind="8x400 Gb/s InfiniBand NDR per 8-GPU node, one NIC per GPU (DGX H100)")
_ETH100_PER8 = Link(bandwidth=12.5 * GB / 8, latency=50e-6, kind="1x100 Gb/s Ethernet per 8-GPU node")

_AMPERE = "NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020)"
_DGX_A100 = "NVIDIA DGX A100 System Architecture whitepaper (2020)"
_A100_PEAK = Peak(fp32=19.5 * TFLOPS, tf32=156 * TFLOPS, bf16=312 * TFLOPS, fp16=312 * TFLOPS)
_HOPPER_PEAK = Peak(fp32=66.9 * TFLOPS, tf32=494.7 * TFLOPS, bf16=989.4 * TFLOPS,
                    fp16=989.4 * TFLOPS, fp8=1978.9 * TFLOPS)
_GA102_PEAK = Peak(fp32=35.6 * TFLOPS, tf32=35.6 * TFLOPS, bf16=71 * TFLOPS, fp16=71 * TFLOPS)
_GA102 = "NVIDIA Ampere GA102 GPU Architecture whitepaper (2020), RTX 3090 column"

_MAMF_A100 = f"matmul efficiency: {MAMF}, row 'NVIDIA A100 SXM' (271.2 of 312 TFLOP/s)"
_MAMF_H100 = (f"matmul efficiency: {MAMF}, row 'NVIDIA H100 SXM' (794.5 of 989 TFLOP/s; the "
              "table notes 'H200 is the same')")
_BABEL_A100_40 = f"bandwidth efficiency: {BABELSTREAM}; this device's run, 1,377.4 of 1,555 GB/s"
_BABEL_A100_80 = f"bandwidth efficiency: {BABELSTREAM}; this device's run, 1,724.8 of 2,039 GB/s"
_MAMF_A100_PCIE = (f"matmul efficiency: {MAMF}, row 'NVIDIA A100 PCIe' (252.9 of 312 TFLOP/s); "
                   "bandwidth: no measurement of this device found, the mean of two A100 "
                   "BabelStream runs")
_MAMF_AMD = (f"matmul efficiency: no MI250 row in {MAMF}; the median of its AMD rows (MI355X "
             "68.0, MI325X 60.4, MI300X 51.4%); bandwidth: the mean of two A100 BabelStream "
             "runs (no AMD measurement found)")
_GENERIC_BANDWIDTH = ("bandwidth efficiency: no published measurement of this device found; the "
                      "mean of two A100 BabelStream runs (docs/simulator.md, 'Cost model')")
_GENERIC_EFFICIENCY = ("matmul and bandwidth efficiency: no published measurement of this device "
                       "found; the median of the NVIDIA rows of the MAMF table, the mean of two "
                       "A100 BabelStream runs (docs/simulator.md, 'Cost model')")

_ENTRIES = (
    Device(
        name="V100-32GB-SXM2", description="NVIDIA Tesla V100 SXM2 32GB (Volta)",
        peak=Peak(fp32=15.7 * TFLOPS, fp16=125 * TFLOPS),
        memory_bytes=32 * GiB, memory_bandwidth=900 * GB, intra=_NVLINK2, inter=_EDR_4X100,
        node_size=8, price_per_hour=2.0,
        sources=(_GENERIC_EFFICIENCY, "NVIDIA Tesla V100 GPU Architecture whitepaper (2017)",
                 "NVIDIA Tesla V100 GPU datasheet (2020)",
                 "NVIDIA DGX-1 with Tesla V100 System Architecture whitepaper (2017)"),
    ),
    Device(
        name="A100-40GB-SXM", description="NVIDIA A100 SXM4 40GB (Ampere)",
        peak=_A100_PEAK, memory_bytes=40 * GiB, memory_bandwidth=1555 * GB,
        intra=_NVLINK3, inter=_HDR_8X200, node_size=8, price_per_hour=2.0,
        matmul_efficiency=0.869, bandwidth_efficiency=round(1377.4 / 1555, 3),
        sources=(_MAMF_A100, _BABEL_A100_40, _AMPERE,
                 "NVIDIA A100 Tensor Core GPU datasheet (2021)", _DGX_A100),
    ),
    Device(
        name="A100-80GB-SXM", description="NVIDIA A100 SXM4 80GB (Ampere)",
        peak=_A100_PEAK, memory_bytes=80 * GiB, memory_bandwidth=2039 * GB,
        intra=_NVLINK3, inter=_HDR_8X200, node_size=8, price_per_hour=2.5,
        matmul_efficiency=0.869, bandwidth_efficiency=round(1724.8 / 2039, 3),
        sources=(_MAMF_A100, _BABEL_A100_80, _AMPERE,
                 "NVIDIA A100 Tensor Core GPU datasheet (2021)", _DGX_A100),
    ),
    Device(
        name="A100-80GB-PCIe", description="NVIDIA A100 PCIe 80GB (Ampere), no NVLink bridge",
        peak=_A100_PEAK, memory_bytes=80 * GiB, memory_bandwidth=1935 * GB,
        intra=_PCIE4, inter=_HDR_4X200, node_size=8, price_per_hour=2.0,
        matmul_efficiency=0.811,
        sources=(_MAMF_A100_PCIE, _AMPERE, "NVIDIA A100 Tensor Core GPU datasheet (2021)",
                 "PCI Express Base Specification, Revision 4.0 (PCI-SIG, 2017)"),
    ),
    Device(
        name="H100-80GB-SXM", description="NVIDIA H100 SXM5 80GB (Hopper)",
        peak=_HOPPER_PEAK, memory_bytes=80 * GiB, memory_bandwidth=3350 * GB,
        intra=_NVLINK4, inter=_NDR_8X400, node_size=8, price_per_hour=3.5,
        matmul_efficiency=0.803,
        sources=(_MAMF_H100, _GENERIC_BANDWIDTH, "NVIDIA H100 Tensor Core GPU datasheet (2023)",
                 "NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022)",
                 "NVIDIA DGX H100 System User Guide (2023)"),
    ),
    Device(
        name="H200-141GB-SXM", description="NVIDIA H200 SXM 141GB (Hopper, HBM3e)",
        peak=_HOPPER_PEAK, memory_bytes=141 * GiB, memory_bandwidth=4800 * GB,
        intra=_NVLINK4, inter=_NDR_8X400, node_size=8, price_per_hour=4.0,
        matmul_efficiency=0.803,
        sources=(_MAMF_H100, _GENERIC_BANDWIDTH, "NVIDIA H200 Tensor Core GPU datasheet (2024)",
                 "NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022)"),
    ),
    Device(
        name="RTX3090", description="NVIDIA GeForce RTX 3090 24GB, PCIe only (no peer-to-peer)",
        peak=_GA102_PEAK, memory_bytes=24 * GiB, memory_bandwidth=936 * GB,
        intra=_PCIE4, inter=_ETH100_PER8, node_size=8, price_per_hour=0.4,
        sources=(_GENERIC_EFFICIENCY, _GA102,
                 "PCI Express Base Specification, Revision 4.0 (PCI-SIG, 2017)"),
    ),
    Device(
        name="RTX3090-NVLink",
        description="NVIDIA GeForce RTX 3090 24GB in a bridged pair; a node is one "
                    "2-GPU workstation, nodes joined by 100 Gb/s Ethernet",
        peak=_GA102_PEAK, memory_bytes=24 * GiB, memory_bandwidth=936 * GB,
        intra=Link(bandwidth=56.25 * GB, latency=5e-6,
                   kind="NVLink 3 bridge, 4 links (112.5 GB/s both directions)"),
        inter=Link(bandwidth=12.5 * GB / 2, latency=50e-6, kind="1x100 Gb/s Ethernet per 2-GPU node"),
        node_size=2, price_per_hour=0.4,
        sources=(_GENERIC_EFFICIENCY, _GA102,
                 "NVIDIA GeForce RTX 3090 product specifications (NVLink bridge)"),
    ),
    Device(
        name="RTX4090", description="NVIDIA GeForce RTX 4090 24GB (Ada), PCIe only",
        peak=Peak(fp32=82.6 * TFLOPS, tf32=82.6 * TFLOPS, bf16=165.2 * TFLOPS,
                  fp16=165.2 * TFLOPS, fp8=330.3 * TFLOPS),
        memory_bytes=24 * GiB, memory_bandwidth=1008 * GB, intra=_PCIE4, inter=_ETH100_PER8,
        node_size=8, price_per_hour=0.7,
        sources=(_GENERIC_EFFICIENCY, "NVIDIA Ada GPU Architecture whitepaper (2022), RTX 4090 column",
                 "PCI Express Base Specification, Revision 4.0 (PCI-SIG, 2017)"),
    ),
    Device(
        name="MI250",
        description="AMD Instinct MI250, one GCD (half an OAM package; PyTorch sees "
                    "each GCD as a device); a node is 4 packages = 8 GCDs",
        peak=Peak(fp32=45.25 * TFLOPS, bf16=181.05 * TFLOPS, fp16=181.05 * TFLOPS),
        memory_bytes=64 * GiB, memory_bandwidth=1638.4 * GB,
        intra=Link(bandwidth=100 * GB, latency=5e-6,
                   kind="Infinity Fabric links between GCDs (per-GCD estimate)"),
        inter=Link(bandwidth=4 * 25 * GB / 8, latency=15e-6,
                   kind="4x200 Gb/s HPE Slingshot-11 per 8-GCD node (LUMI-G, Frontier)"),
        node_size=8, price_per_hour=1.0,
        matmul_efficiency=0.604,
        sources=(_MAMF_AMD, "AMD Instinct MI250 Accelerator datasheet (2021)",
                 "Introducing AMD CDNA 2 Architecture whitepaper (2021)",
                 "HPE Cray EX235a compute blade (LUMI-G) node description"),
    ),
    Device(
        name="CPU-2core",
        description="This project's CPU machine: 2 cores, 24 GiB, no GPU; one gloo rank "
                    "per core, 2 ranks per node",
        peak=Peak(fp32=85e9),
        memory_bytes=12 * GiB, memory_bandwidth=10 * GB,
        intra=Link(bandwidth=1.07 * GB, latency=50e-6,
                   kind="gloo over loopback (4 MiB all-reduce ~ 4 ms at 2 ranks)"),
        inter=Link(bandwidth=1.25 * GB / 2, latency=100e-6, kind="10 Gb/s Ethernet (estimate)"),
        node_size=2, price_per_hour=0.04, rates="measured", comm_overlaps_compute=False, cores=2,
        shared_efficiency=0.75, shared_wait=3.9e-3,
        sources=("PLATFORM.md, 'Speed and memory on these 2 cores': GPT step at ~170 GFLOP/s "
                 "on 2 threads, split over 2 ranks (measured 2026-12-01)",
                 "PLATFORM.md, 'torch.distributed on gloo': 4 MiB all-reduce ~ 4 ms at 2 ranks",
                 "shared_efficiency and shared_wait: `torchweave calibrate --world-sizes 4` on "
                 "this machine, 4 ranks on 2 cores, 2026-12-03, the median of three runs "
                 "(efficiency 1.00, 0.75, 0.74; wait 3.88, 2.74, 6.94 ms: the machine is shared)"),
    ),
)

CATALOG: Mapping[str, Device] = types.MappingProxyType({d.name: d for d in _ENTRIES})
"""Built-in devices by name. Memory bandwidth and latencies of ``CPU-2core`` are
estimates; run ``torchweave calibrate`` to measure them."""


DEFAULT_GPU = "H100-80GB-SXM"


def gpu_entry(name: str, total_memory: int) -> str | None:
    """The catalog entry of a GPU by the name and memory torch reports (``NVIDIA A100-SXM4-80GB``,
    ``NVIDIA H200``, ``Tesla V100-SXM2-32GB``), or None where the catalog has no entry for that
    exact model: its PCIe and NVL forms of H100 and H200 (no NVLink switch), GH200, 16 GB
    V100s, 40 GB PCIe A100s, MIG slices and anything else."""
    words = set(re.split(r"[^A-Z0-9]+", name.upper()))
    if "MIG" in words:
        return None
    pcie = bool(words & {"PCIE", "NVL"})
    gb = total_memory / GiB
    if "A100" in words:
        if pcie:
            return "A100-80GB-PCIe" if gb > 48 else None
        return "A100-80GB-SXM" if gb > 48 else "A100-40GB-SXM"
    if "H100" in words or "H200" in words:
        return None if pcie else ("H200-141GB-SXM" if "H200" in words else "H100-80GB-SXM")
    if any(w.startswith("V100") for w in words):  # V100, V100S
        return "V100-32GB-SXM2" if gb > 24 and not pcie else None
    if "RTX" in words and words & {"3090", "4090"}:
        return "RTX3090" if "3090" in words else "RTX4090"
    if words & {"MI250", "MI250X"}:
        return "MI250"
    return None


def lookup(name: str, catalog: Mapping[str, Device] = CATALOG) -> Device:
    """The catalog entry called ``name`` (case-insensitive)."""
    by_lower = {k.lower(): d for k, d in catalog.items()}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    import difflib

    close = difflib.get_close_matches(name, list(catalog), n=1, cutoff=0.5)
    fix = f"did you mean {close[0]!r}? " if close else ""
    raise SimError(Problem(
        obj="device", value=repr(name), rule=f"must be one of: {', '.join(catalog)}",
        fix=fix + "or describe the device field by field in a cluster YAML"))
