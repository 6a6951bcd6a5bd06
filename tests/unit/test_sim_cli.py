"""`torchweave simulate` and `calibrate`, called through the CLI's main (`explain`: test_explain_cli.py)."""

from __future__ import annotations

import json
import sys

import pytest

from torchweave.cli import main
from torchweave.sim import CATALOG, load_cluster_yaml

pytestmark = pytest.mark.usefixtures("in_tmp_dir")  # default Gantt charts land there


def test_simulate_tp_prints_summary_and_writes_trace(tmp_path, capsys) -> None:
    trace = tmp_path / "tp.json"
    assert main(["simulate", "gpt-tiny", "--cluster", "4xA100-80GB-SXM", "--plan", "tp",
                 "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "tp on 4xA100-80GB-SXM (4 ranks)" in out
    for field in ("step time", "idle", "peak memory", "memory/rank", "MFU", "tokens/s", "$/M tokens"):
        assert field in out, field
    assert "OUT OF MEMORY" not in out
    data = json.loads(trace.read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    assert data["otherData"]["plan"] == "tp" and data["otherData"]["step_time_s"] > 0


def test_simulate_gantt_writes_a_png(tmp_path) -> None:
    png = tmp_path / "g.png"
    assert main(["simulate", "gpt-tiny", "--cluster", "2xA100-80GB-SXM", "--gantt", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_simulate_gantt_without_matplotlib_is_a_message(tmp_path, capsys, monkeypatch) -> None:
    # A None entry in sys.modules makes `import matplotlib` raise ImportError, as if not installed.
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    png = tmp_path / "g.png"
    assert main(["simulate", "gpt-tiny", "--cluster", "2xA100-80GB-SXM", "--gantt", str(png)]) == 0
    out = capsys.readouterr().out
    assert "matplotlib" in out and not png.exists()


def test_bad_cluster_string_names_field_and_devices(capsys) -> None:
    assert main(["simulate", "gpt-tiny", "--cluster", "4xA100-80GB-SXMX", "--plan", "dp"]) == 2
    out = capsys.readouterr().out
    assert "device" in out and "'A100-80GB-SXMX'" in out
    assert all(name in out for name in CATALOG)


def test_bad_cluster_yaml_field(tmp_path, capsys) -> None:
    spec = tmp_path / "c.yaml"
    spec.write_text("device: A100-80GB-SXM\nnodes: 1\ndevices_per_nod: 2\n")
    assert main(["simulate", "gpt-tiny", "--cluster", str(spec)]) == 2
    out = capsys.readouterr().out
    assert "devices_per_nod" in out and "devices_per_node" in out


def test_out_of_memory_names_device_and_contributors(tmp_path, capsys) -> None:
    spec = tmp_path / "tiny.yaml"
    spec.write_text("name: tiny-pair\ndevice:\n  base: A100-80GB-SXM\n  name: tiny-1MiB\n"
                    "  memory_bytes: 1048576\nnodes: 1\ndevices_per_node: 2\n")
    assert main(["simulate", "gpt-tiny", "--cluster", str(spec), "--plan", "dp"]) == 1
    out = capsys.readouterr().out
    assert "OUT OF MEMORY" in out and "tiny-1MiB" in out
    assert "parameters" in out or "activations" in out


@pytest.mark.dist
def test_calibrate_quick_writes_a_cluster_the_simulator_accepts(tmp_path, capsys) -> None:
    out_yaml = tmp_path / "cpu.yaml"
    assert main(["calibrate", "--quick", "--out", str(out_yaml)]) == 0
    out = capsys.readouterr().out
    assert "GFLOP/s" in out and "all_reduce" in out and "alpha-beta fit" in out
    cluster = load_cluster_yaml(out_yaml)
    assert cluster.size == 2 and cluster.device.rates == "measured"
    assert cluster.device.peak.fp32 > 1e8 and cluster.intra.bandwidth > 1e6
    assert main(["simulate", "gpt-tiny", "--cluster", str(out_yaml), "--plan", "dp"]) == 0
    assert "step time" in capsys.readouterr().out


@pytest.mark.dist
def test_calibrate_measures_what_ranks_sharing_cores_reach_and_wait(tmp_path, capsys,
                                                                    monkeypatch) -> None:
    """With more ranks than cores (here: the machine said to have 1 core), calibrate times
    every rank computing at once and the wait of a collective after compute, and writes
    them into the cluster (its rates already a rank's share)."""
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    out_yaml = tmp_path / "cpu.yaml"
    assert main(["calibrate", "--quick", "--out", str(out_yaml)]) == 0
    out = capsys.readouterr().out
    assert "0.5 of a core's time at 2 ranks" in out and "waits" in out
    dev = load_cluster_yaml(out_yaml).device
    assert 0 < dev.shared_efficiency <= 1 and dev.collective_wait == dev.shared_wait >= 0
    assert "of the fair share reached" in dev.sources[0]


def test_simulate_profile_times_ops_here_and_caches_them(tmp_path, monkeypatch, capsys) -> None:
    from torchweave.commands import sim

    monkeypatch.setattr(sim, "PROFILE_CACHE", tmp_path / "ops.json")
    assert main(["simulate", "gpt-tiny", "--cluster", "2xCPU-2core", "--profile"]) == 0
    out = capsys.readouterr().out
    assert "profiled" in out and "step time" in out and (tmp_path / "ops.json").is_file()
    # two ranks of this machine: timed by two processes at once, as training shares the cores
    assert "on 2 ranks at once" in out
    cache = json.loads((tmp_path / "ops.json").read_text())["devices"]
    (device, table), = cache.items()
    assert device.endswith("x2 ranks") and "sync|2" in table and len(table) > 10
    assert main(["simulate", "gpt-tiny", "--cluster", "2xCPU-2core", "--profile"]) == 0
    assert "profiled 0 op pieces" in capsys.readouterr().out  # all cached


def test_a_measured_collective_wait_replaces_the_modelled_one() -> None:
    """Profiles that timed what a collective costs after compute (``sync|N``) stand in for
    the device's modelled wait; they do not add to it."""
    from torchweave.models import FACTORIES
    from torchweave.policies import resolve
    from torchweave.sim import parse_cluster
    from torchweave.sim.hardware.collective_cost import Collective
    from torchweave.sim.hardware.compute import ComputeModel
    from torchweave.sim.hardware.profile import OpProfiles, sync_key
    from torchweave.sim.step.context import StepContext

    import torchweave

    model, args = FACTORIES["gpt-tiny"]()
    g = torchweave.capture(model, args)
    cluster = parse_cluster("4xCPU-2core@4")  # 4 ranks on 2 cores: a modelled wait
    wait = cluster.device.collective_wait
    assert wait > 0

    def ctx(profiles):
        return StepContext(g, resolve("dp", g, 4), cluster, None,
                           ComputeModel.for_device(cluster.device), 2**20, profiles=profiles)

    group = (0, 1, 2, 3)
    modelled = ctx(None).comm(Collective.ALL_REDUCE, 2**16, group)
    measured = ctx(OpProfiles("here", {sync_key(4): (1e-3, 0.0)})).comm(Collective.ALL_REDUCE, 2**16, group)
    assert measured == pytest.approx(modelled - wait + 1e-3)
    other = ctx(OpProfiles("here", {sync_key(2): (1e-3, 0.0)})).comm(Collective.ALL_REDUCE, 2**16, group)
    assert other == pytest.approx(modelled)  # a wait measured for 2 ranks says nothing of 4


def test_out_of_memory_says_whether_the_leanest_plan_fits_and_by_how_much(tmp_path, capsys) -> None:
    """The report measures against zero3 with full recompute: here it fits (devices big enough
    for the sharded state), there it misses, by a number of GiB per device."""
    roomy = tmp_path / "roomy.yaml"
    roomy.write_text("name: pair\ndevice:\n  base: A100-80GB-SXM\n  name: small-2MiB\n"
                     "  memory_bytes: 2097152\nnodes: 1\ndevices_per_node: 2\n")
    assert main(["simulate", "gpt-tiny", "--cluster", str(roomy), "--plan", "dp"]) == 1
    out = capsys.readouterr().out
    assert "OUT OF MEMORY" in out and "as zero3:recompute=full it fits" in out, out
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text("name: pair\ndevice:\n  base: A100-80GB-SXM\n  name: tiny-64KiB\n"
                    "  memory_bytes: 65536\nnodes: 1\ndevices_per_node: 2\n")
    assert main(["simulate", "gpt-tiny", "--cluster", str(tiny), "--plan", "dp"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "does not fit 2 x tiny-64KiB even as zero3:recompute=full" in out, out
    assert "GiB over its" in out


def test_an_out_of_memory_plan_whose_batch_zero3_cannot_split_still_lets_the_next_plan_run(
        tmp_path, capsys) -> None:
    """gpt-tiny's batch of 4 does not divide over 8 ranks, so whether the model fits as
    zero3 on all 8 is not known: the report says so, and the next plan is simulated."""
    small = tmp_path / "small.yaml"
    small.write_text("name: eight\ndevice:\n  base: A100-80GB-SXM\n  name: small-64KiB\n"
                     "  memory_bytes: 65536\nnodes: 1\ndevices_per_node: 8\n")
    assert main(["simulate", "gpt-tiny", "--cluster", str(small), "--plan", "1f1b:pp=4,micro=2",
                 "--plan", "gpipe:pp=4,micro=2"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "is not known: input idx: batch 4; rule:" in out and "4 % 8 != 0" in out, out
    assert "gpipe on" in out and "fastest first" in out, out


def test_simulate_accumulates_the_example_batch_in_micro_batches(capsys) -> None:
    """The example batch (4 for gpt-tiny) is the global batch: --grad-accum 2 simulates two
    micro-batches of 2, the same tokens in a longer step; 3 does not divide it."""
    assert main(["simulate", "gpt-tiny", "--cluster", "2xA100-80GB-SXM", "--plan", "dp"]) == 0
    one = capsys.readouterr().out
    assert main(["simulate", "gpt-tiny", "--cluster", "2xA100-80GB-SXM", "--plan", "dp",
                 "--grad-accum", "2"]) == 0
    two = capsys.readouterr().out
    assert "2 micro-batches accumulated per step" in two

    def ms(out: str) -> float:
        return float(next(x for x in out.splitlines() if "step time" in x).split()[2])

    assert ms(two) > ms(one)
    assert main(["simulate", "gpt-tiny", "--cluster", "2xA100-80GB-SXM", "--grad-accum", "3"]) == 2
    err = capsys.readouterr()
    assert "--grad-accum" in err.out + err.err and "4 % 3 != 0" in err.out + err.err


def test_a_plan_strings_accum_is_the_same_as_grad_accum(capsys) -> None:
    """``dp:accum=2`` simulates what ``--grad-accum 2`` does; both at once must agree; a
    pipeline refuses accum and points at its micro option."""
    assert main(["simulate", "gpt-tiny", "--cluster", "2xA100-80GB-SXM", "--plan", "dp",
                 "--grad-accum", "2"]) == 0
    flag = capsys.readouterr().out
    assert main(["simulate", "gpt-tiny", "--cluster", "2xA100-80GB-SXM", "--plan",
                 "dp:accum=2"]) == 0
    option = capsys.readouterr().out
    assert "2 micro-batches accumulated per step" in option

    def step(out: str) -> str:
        return next(x for x in out.splitlines() if "step time" in x)

    assert step(option) == step(flag)
    assert main(["simulate", "gpt-tiny", "--cluster", "2xA100-80GB-SXM", "--plan",
                 "dp:accum=2", "--grad-accum", "4"]) == 2
    err = capsys.readouterr()
    assert "the plan says accum=2" in err.out + err.err
    assert main(["simulate", "gpt-tiny", "--cluster", "2xA100-80GB-SXM", "--plan",
                 "1f1b:accum=2"]) == 2
    err = capsys.readouterr()
    assert "a pipeline's micro-batches are its micro option" in err.out + err.err


def test_simulate_ranks_several_plans_on_one_capture(capsys, monkeypatch) -> None:
    import re

    import torchweave.commands.sim as sim

    captures = []
    real = sim._capture
    monkeypatch.setattr(sim, "_capture", lambda *a: captures.append(a) or real(*a))
    plans = ["tp", "dp", "1f1b:tp=2,pp=2,micro=2", "zero3:recompute=full"]
    assert main(["simulate", "gpt-tiny", "--cluster", "4xA100-80GB-SXM",
                 *[x for p in plans for x in ("--plan", p)]]) == 0
    out = capsys.readouterr().out
    assert len(captures) == 1 and "captured gpt-tiny once" in out
    table = out[out.index("4 plans on 4xA100-80GB-SXM, fastest first"):]
    rows = [line for line in table.splitlines() if any(f"│ {p} " in line for p in plans)]
    assert len(rows) == 4
    steps = [float(re.search(r"│\s+([\d.]+) us", r).group(1)) for r in rows]
    assert steps == sorted(steps)
    for p in plans:  # each plan's own summary is printed too, as with one --plan
        assert re.search(rf"^{re.escape(p.split(':')[0])}\S* on 4xA100-80GB-SXM", out, re.M), p


def test_a_timeline_is_for_one_plan(tmp_path, capsys) -> None:
    assert main(["simulate", "gpt-tiny", "--cluster", "2xA100-80GB-SXM", "--plan", "dp",
                 "--plan", "tp", "--trace", str(tmp_path / "t.json")]) == 2
    assert "a timeline is written for one plan" in capsys.readouterr().out


def test_simulate_writes_each_plans_numbers_as_json(tmp_path, capsys) -> None:
    """``--json``: one object per plan, the same numbers the summary prints, as data."""
    from torchweave.policies import resolve
    from torchweave.sim import parse_cluster, simulate
    from torchweave.factory import load

    out = tmp_path / "r.json"
    assert main(["simulate", "gpt-tiny", "--cluster", "4xA100-80GB-SXM", "--plan", "tp",
                 "--plan", "zero2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [d["spec"] for d in data] == ["tp", "zero2"]
    m = load("gpt-tiny")
    import torchweave

    g = torchweave.capture(m.model, m.args, m.kwargs) if m.kwargs else torchweave.capture(m.model, m.args)
    direct = simulate(g, resolve("tp", g, 4), parse_cluster("4xA100-80GB-SXM"), timeline=False)
    tp = data[0]
    assert tp["step_time_s"] == pytest.approx(direct.step_time)
    assert [x["peak"] for x in tp["memory_bytes"]] == list(direct.peak_memory)
    assert tp["world_size"] == 4 and len(tp["compute_s"]) == 4 and tp["simulated_in_s"] > 0
    assert f"step time      {tp['step_time_s'] * 1e3:.4g} ms" in capsys.readouterr().out


def test_coshard_from_the_command_line(tmp_path, capsys) -> None:
    """``coshard=`` in a plan string: simulated (less activation memory, a longer step),
    saved as plan.json by ``torchweave plan`` and read back as data; a bad value is refused
    before anything is captured, naming the option and the forms it takes."""
    def sim(plan: str) -> dict:
        out = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        assert main(["simulate", "gpt-tiny", "--cluster", "2xA100-80GB-SXM", "--plan", plan,
                     "--json", str(out)]) == 0
        (row,) = json.loads(out.read_text())
        return row

    plain, chunked = sim("dp"), sim("dp:coshard=mlp+attn:2")
    assert chunked["memory_bytes"][0]["activations"] < plain["memory_bytes"][0]["activations"]
    assert chunked["step_time_s"] > plain["step_time_s"]
    saved = tmp_path / "plan.json"
    assert main(["plan", "gpt-tiny", "--plan", "tp:tp=2,coshard=mlp:2", "--world-size", "2",
                 "--out", str(saved)]) == 0
    assert "co-shard: linear_4_nobias..linear_5_nobias x2" in capsys.readouterr().out
    assert "coshard=mlp:2" in saved.read_text()
    assert main(["simulate", "gpt-tiny", "--cluster", "2xA100-80GB-SXM", "--plan", str(saved)]) == 0
    capsys.readouterr()
    assert main(["simulate", "gpt-tiny", "--cluster", "2xA100-80GB-SXM", "--plan", "dp:coshard=mlp:x"]) == 2
    err = capsys.readouterr()
    assert "coshard is K" in err.out + err.err


def test_simulate_and_explain_draw_the_gantt_chart_by_default(in_tmp_dir, capsys) -> None:
    assert main(["simulate", "gpt-tiny", "--cluster", "2xA100-80GB-SXM", "--plan", "tp"]) == 0
    assert main(["explain", "zero3", "gpt-tiny", "--cluster", "2xA100-80GB-SXM"]) == 0
    out = capsys.readouterr().out
    for name in ("gpt-tiny-tp.gantt.png", "gpt-tiny-zero3.gantt.png"):
        assert (in_tmp_dir / name).read_bytes()[:4] == b"\x89PNG" and f"wrote {name}" in out
    assert main(["simulate", "gpt-tiny", "--cluster", "2xA100-80GB-SXM", "--plan", "dp",
                 "--no-gantt"]) == 0
    assert not (in_tmp_dir / "gpt-tiny-dp.gantt.png").exists()
