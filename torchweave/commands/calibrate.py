"""``torchweave calibrate``: measure this machine and save it as a cluster spec
(:func:`torchweave.sim.hardware.calibrate.calibrate` measures; the YAML it writes has
``rates: measured`` and is accepted by ``--cluster``)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from rich.console import Console


def calibrate_cmd(args: argparse.Namespace, console: Console) -> int:
    from torchweave.runtime.launch import LaunchConfig, spawn
    from torchweave.sim.hardware.calibrate import calibrate
    from torchweave.sim.hardware.cluster import dump_cluster_yaml

    def run_ranks(fn: Any, world_size: int, timeout_s: float, *fn_args: Any) -> list[Any]:
        return spawn(fn, LaunchConfig(world_size=world_size, backend="gloo", timeout_s=timeout_s),
                     *fn_args)

    t_start = time.perf_counter()
    cluster = calibrate(args.world_sizes, run_ranks, quick=args.quick,
                        say=lambda line: console.print(line, highlight=False))
    Path(args.out).write_text(dump_cluster_yaml(cluster))
    console.print(f"wrote {args.out} in {time.perf_counter() - t_start:.1f} s "
                  f"(use it as --cluster {args.out})", highlight=False)
    return 0


__all__ = ["calibrate_cmd"]
