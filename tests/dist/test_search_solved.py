"""Plans whose ops' splits the solver chose (``split=solved``) run and match one device.

The partitions are solved for a cluster whose links cost almost nothing, so the
solver splits every op it can, along whatever dims its model prefers (heads,
hidden units, sequence), with all-to-alls between: the least regular plans the
solver can produce, checked on real gloo ranks against one device.
"""

from __future__ import annotations

import pytest

from tests.conftest import built
from tests.unit.test_search_intra import fast
from torchweave.api import capture
from torchweave.search import resolve
from torchweave.search.intra import tp_dims
from torchweave.verify import Case, verify_many

CASES = [("gpt-tiny", "tp:tp=2,dp=2,split=solved"), ("hf-llama-tiny", "tp:tp=4,split=solved"),
         ("llama-tiny", "1f1b:tp=2,pp=2,micro=2,split=solved"), ("t5-tiny", "tp:tp=4,split=solved")]


@pytest.mark.dist
def test_solved_partitions_match_one_device() -> None:
    cases = []
    for name, spec in CASES:
        model, inputs = built(name)[:2]
        graph = capture(model, inputs)
        plan = resolve(spec, graph, 4, cluster=fast(4))
        split = sum(1 for d in tp_dims(plan, graph).values() if d is not None)
        assert split > len(graph.nodes) // 5, (name, split)  # a real partition, not all whole
        cases.append(Case(model, inputs, plan, steps=2, name=f"{name}/{spec}"))
    for case, report in zip(cases, verify_many(cases, world_size=4)):
        assert report.ok, f"{case.name}: {report}"
        assert report.grads and report.params
