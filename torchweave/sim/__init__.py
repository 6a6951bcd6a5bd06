"""Clusters and the cost model: what a plan will cost before the GPUs are rented.

- :mod:`~torchweave.sim.devices`: accelerator specs and the built-in catalog;
- :mod:`~torchweave.sim.cluster`: clusters from strings (``64xA100-80GB-SXM``) or YAML;
- :mod:`~torchweave.sim.cost`: compute time of an op (roofline);
- :mod:`~torchweave.sim.comm`: collective time (α-β, ring/tree, hierarchical);
- :mod:`~torchweave.sim.memory`: model-state memory per ZeRO stage;
- :mod:`~torchweave.sim.simulate`: one training step of a lowered plan, event by
  event (:mod:`~torchweave.sim.tasks` builds the tasks, :mod:`~torchweave.sim.engine` runs them);
- :mod:`~torchweave.sim.trace`: the timeline as Chrome trace JSON or a PNG Gantt chart;
- :mod:`~torchweave.sim.profile`: measured op times, cached by op, shape, dtype and device;
- :mod:`~torchweave.sim.pipeline`: pipeline schedules in time and memory;
- :mod:`~torchweave.sim.symmetry`, :mod:`~torchweave.sim.fold`: the fast path for large plans.
"""

from torchweave.sim.cluster import (
    Cluster, cluster_from_dict, cluster_of, cluster_to_dict, dump_cluster_yaml,
    load_cluster_yaml, parse_cluster,
)
from torchweave.sim.comm import (
    Algorithm, Collective, CommCost, collective_of, collective_options, collective_time, flat_time,
)
from torchweave.sim.cost import ComputeModel, OpTime, dtype_of, op_time, roofline
from torchweave.sim.devices import CATALOG, Device, Link, Peak, lookup
from torchweave.sim.engine import Event
from torchweave.sim.memory import ModelStateMemory, model_state_memory
from torchweave.sim.pipeline import PipelineStep, StageCost, simulate_schedule
from torchweave.sim.profile import OpProfiles, profile_graph
from torchweave.sim.simulate import MemoryUse, OutOfMemory, SimResult, simulate
from torchweave.sim.trace import save_gantt_png, to_chrome_trace

__all__ = [
    "CATALOG", "Algorithm", "Cluster", "Collective", "CommCost", "ComputeModel", "Device", "Event",
    "Link", "MemoryUse", "ModelStateMemory", "OpProfiles", "OpTime", "OutOfMemory", "Peak",
    "PipelineStep", "SimResult", "StageCost",
    "cluster_from_dict", "cluster_of", "cluster_to_dict",
    "collective_of", "collective_options", "collective_time", "dtype_of", "dump_cluster_yaml",
    "flat_time", "load_cluster_yaml", "lookup", "model_state_memory", "op_time", "parse_cluster",
    "profile_graph", "roofline", "save_gantt_png", "simulate", "simulate_schedule",
    "to_chrome_trace",
]
