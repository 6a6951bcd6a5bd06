"""The search's worker processes (search/pool.py): the same answers as one process, and
nothing left behind."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.unit.test_search import _gpt
from torchweave.errors import TorchweaveError
from torchweave.search import Constraints, Degrees, search
from torchweave.sim import parse_cluster


def test_worker_processes_give_the_same_search(monkeypatch) -> None:
    """Proxies and simulations on two spawned workers: the same ranking, numbers and reasons
    as in one process (the answers come back in the order asked)."""
    from torchweave.search.pool import default_workers

    c = Constraints(tp=Degrees(only=(1, 2, 4)), schedules=("none", "1f1b"), zero=(0, 1),
                    recompute=("none", "full"))
    cluster = parse_cluster("8xA100-80GB-SXM")
    one = search(_gpt(), cluster, c, top=0, simulate_top=6, workers=1)
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("torchweave-search-*"))
    two = search(_gpt(), cluster, c, top=0, simulate_top=6, workers=2)
    assert set(tmp.glob("torchweave-search-*")) == before  # the workers' state file is gone
    assert [(r.spec, r.result.step_time, r.estimate) for r in one.ranked] == \
        [(r.spec, r.result.step_time, r.estimate) for r in two.ranked]
    assert one.excluded == two.excluded and len(one.ranked) >= 6
    assert default_workers(len(_gpt().nodes), 8) == 1  # a small search stays in one process
    monkeypatch.setenv("TORCHWEAVE_SEARCH_WORKERS", "two")
    with pytest.raises(TorchweaveError, match="TORCHWEAVE_SEARCH_WORKERS"):
        default_workers(10, 8)
