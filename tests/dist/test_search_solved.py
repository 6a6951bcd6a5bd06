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


@pytest.mark.dist
def test_the_large_vocabulary_partition_matches_one_device() -> None:
    """The solver's nnScaler-like answer for a large vocabulary, priced on A100s: blocks split
    along the batch on the tp axis (under dp's own batch split: the same dim twice), the
    embedding and head along the vocabulary, with the exchanges between derived."""
    import torch

    from torchweave.models.gpt import GPT, GPTConfig
    from torchweave.sim import parse_cluster
    from tests.unit.test_search_intra import _batch_dims

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=8192, block_size=64, n_layer=2, n_head=4, d_model=256))
    inputs = (torch.randint(0, 8192, (32, 64)), torch.randint(0, 8192, (32, 64)))
    graph = capture(model, inputs)
    plan = resolve("tp:tp=2,dp=2,split=solved", graph, 4, cluster=parse_cluster("4xA100-80GB-SXM@4"))
    dims, batch = tp_dims(plan, graph), _batch_dims(graph)
    head = [n for n in graph.nodes if n.module == "lm_head" and n.target == "aten.linear.default"]
    mm = [n for n in graph.nodes if n.module.startswith("blocks.")
          and n.target == "aten.linear.default"]
    assert head and all(dims[n.name] == "n" for n in head)
    assert mm and all(dims[n.name] in batch[n.name] for n in mm)
    (report,) = verify_many([Case(model, inputs, plan, steps=2, name="vocab")], world_size=4)
    assert report.ok, str(report)
    assert report.grads and report.params
