"""Layers import only downward (docs/architecture.md), checked by import-linter."""

import shutil
import subprocess
from pathlib import Path

import pytest


def test_import_layers() -> None:
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("import-linter is a test dependency: pip install -e '.[test]'")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([exe], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
