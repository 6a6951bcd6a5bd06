"""Clusters and the cost model: what a plan will cost before the GPUs are rented.

Four packages, each importing only those below it (docs/simulator.md, "Pieces"):

- :mod:`~torchweave.sim.hardware`: devices and clusters, collective time,
  op compute time (roofline or measured), model-state memory, failures;
- :mod:`~torchweave.sim.explain`: what a simulation tells (:class:`SimResult`),
  the timeline as Chrome trace JSON or a PNG Gantt chart;
- :mod:`~torchweave.sim.step`: one training step as per-rank tasks (forward,
  backward, gradient sums, optimizer), the event engine that runs them,
  pipeline schedules in time and memory, accumulation;
- :mod:`~torchweave.sim.fast`: the fast paths at scale (one replica for all,
  folded blocks, pipeline stages simulated once);

and :func:`~torchweave.sim.simulate.simulate` on top, which picks the path;
:func:`~torchweave.sim.op_table.explain_plan` (``torchweave explain``'s table) reads a
simulation per op. :func:`~torchweave.sim.hardware.calibrate.calibrate` measures this
machine as a cluster (``torchweave calibrate``).
"""

from torchweave.sim.hardware.cluster import (
    Cluster, cluster_from_dict, cluster_of, cluster_to_dict, dump_cluster_yaml,
    load_cluster_yaml, parse_cluster,
)
from torchweave.sim.hardware.collective_cost import (
    Algorithm, Collective, CommCost, collective_of, collective_options, collective_time, flat_time,
)
from torchweave.sim.hardware.compute import ComputeModel, OpTime, dtype_of, op_time, roofline
from torchweave.sim.hardware.devices import CATALOG, Device, Link, Peak, lookup
from torchweave.sim.explain.result import Event
from torchweave.sim.hardware.memory import ModelStateMemory, model_state_memory
from torchweave.sim.step.schedule import PipelineStep, StageCost, simulate_schedule
from torchweave.sim.hardware.profile import OpProfiles, profile_graph
from torchweave.sim.simulate import MemoryUse, OutOfMemory, SimResult, simulate
from torchweave.sim.explain.trace import save_gantt_png, to_chrome_trace
from torchweave.sim.hardware.calibrate import calibrate
from torchweave.sim.op_table import Explained, OpRow, explain_plan

__all__ = [
    "CATALOG", "Algorithm", "Cluster", "Collective", "CommCost", "ComputeModel", "Device", "Event",
    "Explained", "Link", "MemoryUse", "OpRow", "ModelStateMemory", "OpProfiles", "OpTime", "OutOfMemory", "Peak",
    "PipelineStep", "SimResult", "StageCost",
    "calibrate", "cluster_from_dict", "cluster_of", "cluster_to_dict",
    "collective_of", "collective_options", "collective_time", "dtype_of", "dump_cluster_yaml",
    "explain_plan", "flat_time", "load_cluster_yaml", "lookup", "model_state_memory", "op_time", "parse_cluster",
    "profile_graph", "roofline", "save_gantt_png", "simulate", "simulate_schedule",
    "to_chrome_trace",
]
