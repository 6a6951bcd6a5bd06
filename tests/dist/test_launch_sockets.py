"""A local launch listens on loopback only: no TCP socket other machines can reach."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torchweave.runtime.launch import LaunchConfig, spawn

_LISTEN = "0A"


def launch_pids(parent: int) -> list[int]:
    """``parent`` and every process below it."""
    out, todo = [], [parent]
    while todo:
        pid = todo.pop()
        out.append(pid)
        for task in Path(f"/proc/{pid}/task").iterdir():
            children = (task / "children").read_text().split()
            todo.extend(int(c) for c in children)
    return out


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_addr)
    # /proc/net/tcp{,6} prints each 32-bit word in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _listeners() -> dict[int, tuple[str, int]]:
    """Socket inode → (address, port) of every TCP and TCP6 socket in LISTEN state."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            local, state, inode = cols[1], cols[3], int(cols[9])
            if state == _LISTEN:
                addr, port = local.split(":")
                out[inode] = (str(_address(addr)), int(port, 16))
    return out


def listening(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket the processes ``pids`` hold."""
    table = _listeners()
    found = []
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                inode = int(target[len("socket:["):-1])
                if inode in table:
                    found.append((pid, *table[inode]))
    return sorted(found)


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _sockets_during_a_collective(ctx, parent: int) -> dict:
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"sum": float(t), "found": listening(launch_pids(parent))}


@pytest.mark.dist
def test_a_local_launch_listens_on_loopback_only() -> None:
    parent = os.getpid()
    outs = spawn(_sockets_during_a_collective, LaunchConfig(world_size=2, timeout_s=30.0), parent)
    for out in outs:
        assert out["sum"] == 2.0
        pids = {pid for pid, _, _ in out["found"]}
        assert len(pids - {parent}) == 2, out["found"]  # each rank's gloo listener was seen
        exposed = [f for f in out["found"] if not _is_loopback(f[1])]
        assert exposed == [], f"listening beyond loopback: {exposed}"
