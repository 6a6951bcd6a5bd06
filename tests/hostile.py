"""Hostile files for the trust tests: pickles that would run a command when loaded."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path


def _s(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + struct.pack("<B", len(data)) + data  # SHORT_BINUNICODE


def _g(module: str, name: str) -> bytes:
    return _s(module) + _s(name) + b"\x93"  # STACK_GLOBAL


def _call(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle of ``module.name(arg)``."""
    return b"\x80\x04" + _g(module, name) + _s(arg) + b"\x85R."  # TUPLE1 REDUCE STOP


def _getattr_chain(cmd: str) -> bytes:
    """``getattr(getattr(getattr(_get_layout, '__globals__'), 'get')('os'), 'system')(cmd)``:
    only classes the old unpickler admitted, plus ``builtins.getattr``."""
    ga = _g("builtins", "getattr")
    return (b"\x80\x04" + ga + ga + ga + _g("torch.serialization", "_get_layout")
            + _s("__globals__") + b"\x86R" + _s("get") + b"\x86R" + _s("os") + b"\x85R"
            + _s("system") + b"\x86R" + _s(cmd) + b"\x85R.")


def hostile_pickles(marker: Path) -> dict[str, tuple[bytes, str]]:
    cmd = f"touch {marker}"
    dcp = "torch.distributed.checkpoint"
    return {
        "dotted under a DCP module": (_call(f"{dcp}.metadata", "os.system", cmd),
                                      f"{dcp}.metadata.os.system"),
        "dotted under the filesystem module": (_call(f"{dcp}.filesystem", "os.system", cmd),
                                               f"{dcp}.filesystem.os.system"),
        "os.system": (_call("os", "system", cmd), "os.system"),
        "posix.system": (_call("posix", "system", cmd), "posix.system"),
        "builtins.eval": (_call("builtins", "eval", f"__import__('os').system({cmd!r})"),
                          "builtins.eval"),
        "dotted under torch": (_call("torch", "os.system", cmd), "torch.os.system"),
        "builtins.getattr": (_getattr_chain(cmd), "builtins.getattr"),
        "a byte entry": (_call(f"{dcp}.metadata", "BytesStorageMetadata", "x"),
                         f"{dcp}.metadata.BytesStorageMetadata"),
    }


def plant(good: Path, step: int, payload: bytes) -> Path:
    """A copy of checkpoint ``good`` as ``step-<step>`` beside it, its ``.metadata`` replaced."""
    bad = good.parent / f"step-{step}"
    shutil.copytree(good, bad)
    (bad / ".metadata").write_bytes(payload)
    meta = json.loads((bad / "torchweave.json").read_text())
    (bad / "torchweave.json").write_text(json.dumps({**meta, "step": step}))
    return bad
