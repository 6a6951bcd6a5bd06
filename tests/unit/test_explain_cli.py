"""`torchweave explain`, called through the CLI's main: per op partition, devices, the
communication inserted and its time; the fit; pipelines; folded models; its two forms."""

from __future__ import annotations

import pytest

from torchweave.cli import main

pytestmark = pytest.mark.usefixtures("in_tmp_dir")  # default Gantt charts land there


def test_explain_tp_rows_communication_and_comparison(capsys) -> None:
    assert main(["explain", "tp", "gpt-tiny", "--cluster", "4xA100-80GB-SXM", "--vs", "dp",
                 "--all"]) == 0
    out = capsys.readouterr().out
    for col in ("node", "partition", "devices", "communication before", "time", "memory"):
        assert col in out
    rows = [line for line in out.splitlines() if "linear_3 " in line and "all_reduce" in line]
    assert rows, "the row-parallel bias add gets the all-reduce of its input"
    assert "top 5 ops by time" in out and "top 5 collectives by time" in out
    assert "why not 'dp'?" in out
    for what in ("step time", "comm time/rank", "peak memory"):
        assert what in out.split("why not")[1]
    assert "biggest per-op differences" in out


def test_explain_takes_the_plan_as_every_other_command_does(capsys) -> None:
    args = ["--cluster", "4xA100-80GB-SXM", "--no-gantt"]
    assert main(["explain", "gpt-tiny", "--plan", "tp", *args]) == 0
    new = capsys.readouterr().out
    assert main(["explain", "tp", "gpt-tiny", *args]) == 0
    assert capsys.readouterr().out == new and "plan 'tp'" in new
    assert main(["explain", "tp", "--cluster", "4xA100-80GB-SXM", "gpt-tiny", "--no-gantt"]) == 0
    assert capsys.readouterr().out == new  # the older form with an option between its two
    with pytest.raises(SystemExit):
        main(["explain", "tp", "--cluster", "4xA100-80GB-SXM", "gpt-tiny", "--no-such-flag"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    for bad in (["explain", "gpt-tiny", *args], ["explain", "tp", "gpt-tiny", "--plan", "dp", *args]):
        assert main(bad) == 2
        out = capsys.readouterr().out
        assert "MODEL --plan PLAN" in out and "torchweave explain gpt-small --plan" in out, out


def test_explain_times_a_pipelines_collectives(capsys) -> None:
    """A pipelined plan's timeline has stage actions, not collectives: explain times them
    from the tasks each stage is costed by (it printed "(no communication)" before)."""
    assert main(["explain", "gpt-tiny", "--plan", "1f1b:tp=2,pp=2", "--cluster",
                 "4xA100-80GB-SXM", "--no-gantt", "--all"]) == 0
    out = capsys.readouterr().out
    top = out.split("collectives by time:")[1]
    assert "no communication" not in top and "all_reduce linear_3_nobias" in top, top
    row = next(line for line in out.splitlines() if "all_reduce linear_3_nobias (" in line)
    assert "(0 ms)" not in row and " us)" in row, row


def test_explain_plan_json(tmp_path, capsys) -> None:
    plan = tmp_path / "tp.json"
    assert main(["plan", "gpt-tiny", "--plan", "tp", "--world-size", "2", "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["explain", str(plan), "gpt-tiny", "--cluster", "2xA100-80GB-SXM"]) == 0
    assert "all_reduce" in capsys.readouterr().out


def test_explain_checks_the_plan_fits_the_cluster(tmp_path, capsys) -> None:
    plan = tmp_path / "dp4.json"
    assert main(["plan", "gpt-tiny", "--plan", "dp", "--world-size", "4", "--out", str(plan)]) == 0
    capsys.readouterr()
    # Too many ranks: an error naming the plan's field and the rule, before lowering.
    assert main(["explain", str(plan), "gpt-tiny", "--cluster", "2xA100-80GB-SXM"]) == 2
    out = capsys.readouterr().out
    assert "world_size" in out and "a plan must fit the cluster" in out and "2 devices" in out
    # Fits in devices and memory.
    assert main(["explain", str(plan), "gpt-tiny", "--cluster", "8xA100-80GB-SXM"]) == 0
    assert "fits: uses 4 of the cluster's 8 devices" in capsys.readouterr().out
    # Out of memory: the device, the rule and the biggest contributors; exit status 1.
    spec = tmp_path / "tiny.yaml"
    spec.write_text("device:\n  base: A100-80GB-SXM\n  name: tiny-1MiB\n  memory_bytes: 1048576\n"
                    "nodes: 1\ndevices_per_node: 4\n")
    assert main(["explain", str(plan), "gpt-tiny", "--cluster", str(spec)]) == 1
    out = capsys.readouterr().out
    assert "does not fit: OUT OF MEMORY" in out and "tiny-1MiB" in out
    assert "must fit its device" in out and "biggest:" in out


def test_explain_pipelined_plan_shows_stages_and_bubble(capsys) -> None:
    assert main(["explain", "1f1b", "gpt-tiny", "--cluster", "2xA100-80GB-SXM", "--all"]) == 0
    out = capsys.readouterr().out
    assert "stage" in out.splitlines()[1] or " stage " in out
    assert "1f1b schedule, 2 stages" in out and "bubble" in out and "in flight" in out


def test_explain_folded_model_gives_every_block_its_communication() -> None:
    """Blocks past the 4th are not simulated (sim/fast/fold.py); their rows read block 3's times."""
    import torch

    import torchweave
    from torchweave.sim.op_table import explain_plan
    from torchweave.models.gpt import GPT, GPTConfig
    from torchweave.policies import resolve
    from torchweave.sim import parse_cluster

    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=20, n_head=4, d_model=64)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.empty(4, 32, dtype=torch.long)
    g = torchweave.capture(model, (idx, idx))
    assert len(g.nodes) >= 500  # folded automatically
    ex = explain_plan(g, resolve("tp", g, 2), parse_cluster("2xA100-80GB-SXM"))
    assert ex.result.folded_blocks and any("identical" in n for n in ex.result.notes)
    by_block: dict[int, float] = {}
    for row, node in zip(ex.rows, g.nodes):
        if node.module.startswith("blocks.") and row.comm:
            b = int(node.module.split(".")[1])
            by_block[b] = by_block.get(b, 0.0) + row.comm_time
    assert set(by_block) == set(range(20))
    assert by_block[12] == pytest.approx(by_block[3]) and by_block[12] > 0
