"""Pipeline messages in one order per pair of ranks, so that nothing relies on tags (no processes).

The executor issues exactly ``Program.messages``; :func:`check_order` (run by
lowering, before launch) compares, for every ordered pair of ranks, the
sender's sends with the receiver's posted receives.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import captured
from torchweave.lower.lower import lower
from torchweave.lower.messages import check_order
from torchweave.plan.schedules import ScheduleError
from torchweave.policies import resolve

GRID = [
    ("gpt-tiny", "gpipe", 2), ("gpt-tiny", "1f1b", 2), ("gpt-tiny", "interleaved", 2),
    ("gpt-tiny", "zb", 2), ("gpt-tiny", "interlaced", 2), ("llama-tiny", "interlaced", 4),
    ("gpt-tiny", "gpipe:micro=8", 4), ("gpt-tiny", "interleaved:micro=8", 4),
    ("recycler-tiny", "1f1b:micro=4,recycle=3", 2), ("recycler-tiny", "1f1b:tp=2,recycle=3", 4),
    ("recycler-tiny", "interleaved:micro=4,recycle=2", 4), ("gpt-tiny", "1f1b:tp=2", 4),
    ("gpt-tiny", "gpipe:dp=2,zero=1", 4), ("gpt-tiny", "1f1b:dp=2,tp=2,zero=1", 8),
    ("llama-tiny", "interleaved:dp=2,tp=2,zero=2", 8), ("recycler-tiny", "zb:dp=2,tp=2,zero=1,recycle=2", 8),
]


def _programs(name: str, plan: str, world_size: int):
    graph = captured(name)
    return lower(graph, resolve(plan, graph, world_size))


def _pairs(programs) -> dict[tuple[int, int], tuple[list, list]]:
    """(src, dst) -> (what src sends dst, what dst posts from src), each in issue order."""
    out: dict[tuple[int, int], tuple[list, list]] = {}
    for prog in programs:
        for ex in prog.messages:
            for x in ex.sends:
                out.setdefault((x.src, x.dst), ([], []))[0].append(x)
            for x in ex.posts:
                out.setdefault((x.src, x.dst), ([], []))[1].append(x)
    return out


@pytest.mark.parametrize("name,plan,world_size", GRID)
def test_every_pair_sends_and_receives_in_one_order(name: str, plan: str, world_size: int) -> None:
    programs = _programs(name, plan, world_size)
    pairs = _pairs(programs)
    if "pp=1" not in plan:
        assert pairs, "a pipeline sends messages between ranks"
    for (src, dst), (sent, posted) in pairs.items():
        assert src != dst
        assert sent == posted, f"rank {src} -> rank {dst}"
        assert len(set(sent)) == len(sent), "each message once"
    for prog in programs:
        assert len(prog.messages) == len(prog.actions)
        posted = set()
        for ex in prog.messages:
            posted |= set(ex.posts)
            assert all(x in posted for x in ex.needs if x.src != prog.rank), "received before it is read"


@pytest.mark.parametrize("name,plan,world_size", [
    ("llama-tiny", "interleaved", 4), ("gpt-tiny", "interlaced", 2),
    ("recycler-tiny", "1f1b:micro=4,recycle=3", 2)])
def test_receives_follow_the_senders_order_where_need_order_differs(name: str, plan: str,
                                                                     world_size: int) -> None:
    """Receiving in the order the actions read (the executor before this order model) differs
    from the senders' order on these schedules; the check catches that order."""
    programs = _programs(name, plan, world_size)
    assert any(set(ex.posts) - set(ex.needs) for p in programs for ex in p.messages), \
        "some receive runs ahead of its action, to follow the sender's order"
    for prog in programs:
        prog.messages = [dataclasses.replace(ex, posts=tuple(x for x in ex.needs if x.src != prog.rank))
                         for ex in prog.messages]
    with pytest.raises(ScheduleError) as err:
        check_order(programs)
    text = str(err.value)
    assert "pipeline messages out of order between ranks" in text
    assert "each pair of ranks issues its sends and receives in one order" in text
    assert "[" in text and "rank 0 |" in text.replace("rank 0  |", "rank 0 |")


def test_a_swapped_pair_of_receives_is_named_with_the_position() -> None:
    programs = _programs("gpt-tiny", "1f1b", 2)
    check_order(programs)
    rank1 = programs[1]
    steps = [i for i, ex in enumerate(rank1.messages) if ex.posts]
    a, b = steps[0], steps[1]
    first, second = rank1.messages[a].posts[0], rank1.messages[b].posts[0]
    rank1.messages[a] = dataclasses.replace(rank1.messages[a], posts=(second,))
    rank1.messages[b] = dataclasses.replace(rank1.messages[b], posts=(first,))
    with pytest.raises(ScheduleError) as err:
        check_order(programs)
    text = str(err.value)
    assert "messages from rank 0 to rank 1" in text
    assert f"message 0: rank 0 sends {first} at step" in text
    assert f"rank 1 receives {second} at step {a}" in text
    assert f"[{rank1.actions[a]}]" in text
    assert "not received by then" in text  # the first action reads what it no longer receives


def test_a_send_without_its_receive_is_reported() -> None:
    programs = _programs("gpt-tiny", "gpipe", 2)
    last = max(i for i, ex in enumerate(programs[1].messages) if ex.posts)
    ex = programs[1].messages[last]
    programs[1].messages[last] = dataclasses.replace(ex, posts=ex.posts[:-1], needs=ex.needs[:-1])
    with pytest.raises(ScheduleError, match="rank 1 receives nothing more"):
        check_order(programs)


def test_p2p_tags_is_a_validated_option_reached_from_the_cli_and_the_train_config() -> None:
    from torchweave.cli import build_parser
    from torchweave.errors import TorchweaveError
    from torchweave.runtime.executor import StepConfig
    from torchweave.train.config import ConfigError
    from torchweave.train.loading import load_config

    assert StepConfig().p2p_tags == "auto" and StepConfig(p2p_tags="untagged").p2p_tags == "untagged"
    with pytest.raises(TorchweaveError) as err:
        StepConfig(p2p_tags="none")
    assert "StepConfig.p2p_tags" in str(err.value) and "'untagged'" in str(err.value)
    args = build_parser().parse_args(["verify", "gpt-tiny", "--plan", "1f1b", "--p2p-tags", "untagged"])
    assert args.p2p_tags == "untagged"
    assert load_config(None, ["--parallel.p2p_tags=untagged"]).parallel.p2p_tags == "untagged"
    with pytest.raises(ConfigError, match="parallel.p2p_tags"):
        load_config(None, ["--parallel.p2p_tags=off"])
