"""The `torchweave` command, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from torchweave.cli import main
from torchweave.models import FACTORIES, gpt


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchweave", *args], capture_output=True,
                          text=True, timeout=300)


def test_help_lists_subcommands() -> None:
    out = run("--help")
    assert out.returncode == 0
    assert "inspect" in out.stdout and "models" in out.stdout


def test_inspect_bundled_model_prints_rows_and_totals(capsys) -> None:
    assert main(["inspect", "gpt-tiny"]) == 0
    out = capsys.readouterr().out
    for col in ("op", "source", "shapes", "annotation", "splittable", "GFLOPs", "MB"):
        assert col in out
    assert "gpt.py:" in out and "linear" in out and "k+" in out
    assert "parameters:" in out and "FLOPs per train step" in out


def test_inspect_user_file_factory(tmp_path) -> None:
    src = tmp_path / "mine.py"
    src.write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        def factory():
            m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
            return m, (torch.randn(4, 8),)
    """))
    out = run("inspect", f"{src}:factory", "--json", str(tmp_path / "t.json"))
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["params"] == 8 * 16 + 16 + 16 * 4 + 4
    assert [r["op"] for r in data["ops"]].count("linear") == 2


def test_a_model_file_imports_the_modules_beside_it(tmp_path) -> None:
    """As ``python mine.py`` would, from any working directory."""
    (tmp_path / "layers.py").write_text("import torch.nn as nn\nWIDTH = 12\n"
                                       "def block():\n    return nn.Linear(WIDTH, WIDTH)\n")
    src = tmp_path / "mine.py"
    src.write_text(textwrap.dedent("""
        import torch
        from layers import WIDTH, block
        def factory():
            return block(), (torch.randn(2, WIDTH),)
    """))
    out = run("inspect", f"{src}:factory", "--json", str(tmp_path / "t.json"))
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "t.json").read_text())["params"] == 12 * 12 + 12


def test_bad_model_spec_is_a_clear_error(capsys) -> None:
    assert main(["inspect", "no-such-model"]) == 2
    out = capsys.readouterr().out
    assert "gpt-small" in out and "file.py:factory" in out


@pytest.mark.parametrize("name", ["gpt-small", "gpt-175b"])
def test_gpt_flops_agree_with_the_standard_count(name: str) -> None:
    """6·N·tokens + 12·L·d·s·tokens (PaLM, appendix B), within 2%."""
    import torchweave

    model, inputs = FACTORIES[name]()
    summary = torchweave.summarize(torchweave.capture(model, inputs))
    b, s = inputs[0].shape
    want = gpt.flops_per_token(model.cfg, s) * b * s
    assert abs(summary.train_flops / want - 1) < 0.02


def test_user_strings_with_square_brackets_print_as_plain_text(capsys) -> None:
    """Error texts, node names and module paths hold square brackets (``layers[/0]``);
    rich once read them as markup and the CLI died with MarkupError before the user saw
    the error. The CLI's console reads no markup."""
    import io

    from torchweave.cli import main, plain_console

    console = plain_console()
    console.file = io.StringIO()
    console.print("model.layers[/0].mlp [bold]x[/bold] closing tag '[/...'")
    assert "model.layers[/0].mlp [bold]x[/bold] closing tag '[/...'" in console.file.getvalue()
    assert main(["plan", "gpt-tiny", "--plan", "dp:recompute=[/x]"]) == 2
    out = capsys.readouterr()
    assert "recompute=[/x]" in out.out + out.err
