"""Bodies of the ``torchweave`` subcommands, one module each: inspect (and models), plan (and
verify), sim (simulate), explain, calibrate, search (plan's search), train (and demo).

:mod:`torchweave.cli` parses the arguments and calls these; each takes the
parsed ``argparse.Namespace`` and a rich ``Console`` and returns the exit
status (0 ok, 1 the plan does not fit, 2 bad input via ``TorchweaveError``).
"""

from torchweave.commands.calibrate import calibrate_cmd
from torchweave.commands.explain import explain_cmd
from torchweave.commands.sim import load_cluster, simulate_cmd

__all__ = ["calibrate_cmd", "explain_cmd", "load_cluster", "simulate_cmd"]
