"""Pipeline schedules: actions per rank, built-in orders, communication, checks.

Plain data and pure functions; imports only :mod:`torchweave.errors` and the
standard library, so lowering, the runtime, the simulator and the search can
all read schedules without pulling in the rest of ``plan``.
"""

from torchweave.plan.schedules.actions import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    StageToRank,
    format_schedule,
    from_csv,
    infer_stage_to_rank,
    loop_stage_to_rank,
    stages_on_rank,
    to_csv,
)
from torchweave.plan.schedules.builtin import (
    BUILTIN,
    builtin,
    check_stage_count,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble_h1,
)
from torchweave.plan.schedules.check import bubble_fraction, dry_run, peak_in_flight, timeline
from torchweave.plan.schedules.sendrecv import add_communication

__all__ = [
    "BUILTIN",
    "Action",
    "Kind",
    "Schedule",
    "ScheduleError",
    "StageToRank",
    "add_communication",
    "bubble_fraction",
    "builtin",
    "check_stage_count",
    "dry_run",
    "format_schedule",
    "from_csv",
    "gpipe",
    "infer_stage_to_rank",
    "interleaved_1f1b",
    "loop_stage_to_rank",
    "one_f_one_b",
    "peak_in_flight",
    "stages_on_rank",
    "timeline",
    "to_csv",
    "zero_bubble_h1",
]
