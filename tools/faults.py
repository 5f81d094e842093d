"""Network faults for tools/chaos.py: one process cut off from the daemon's port, on loopback, by firewall rules.

A partition drops, in both directions, the packets of the process's established TCP connections to the daemon's
port (found in /proc: its socket inodes, matched in its net/tcp tables), with iptables rules on the loopback
interface tagged `gyre-chaos`. The process keeps running and keeps its connections: what it sends waits in its
socket (TCP retransmits it once the rules are gone, after a backoff that grows with the partition), exactly as
when a node loses the network to the daemon's. A connection the process opens during the partition is not cut.
Needs root and iptables (`apt-get install iptables`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

TAG = "gyre-chaos"


def connections_to(pid: int, port: int) -> list[int]:
    """The local ports of `pid`'s TCP connections to `port` (any address of this machine)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    local: list[int] = []
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[9] in inodes and int(f[2].rsplit(":", 1)[1], 16) == port and f[3] == "01":  # ESTABLISHED
                local.append(int(f[1].rsplit(":", 1)[1], 16))
    return local


def _rules(local: int, port: int) -> list[list[str]]:
    tag = ["-m", "comment", "--comment", TAG]
    return [["INPUT", "-i", "lo", "-p", "tcp", "--sport", str(local), "--dport", str(port), *tag, "-j", "DROP"],
            ["INPUT", "-i", "lo", "-p", "tcp", "--sport", str(port), "--dport", str(local), *tag, "-j", "DROP"]]


def usable() -> str | None:
    """Why partitions cannot be made here, or None."""
    if shutil.which("iptables") is None:
        return "partitions need iptables (apt-get install iptables)"
    if os.geteuid() != 0:
        return "partitions need root (iptables rules)"
    return None


class Partition:
    """`pid` cut off from the daemon's `port` while open."""

    def __init__(self, pid: int, port: int) -> None:
        self.rules = [r for local in connections_to(pid, port) for r in _rules(local, port)]

    def __enter__(self) -> Partition:
        for r in self.rules:
            subprocess.run(["iptables", "-I", *r], check=True)
        return self

    def __exit__(self, *_exc: object) -> None:
        for r in self.rules:
            subprocess.run(["iptables", "-D", *r], check=False)


def heal_all() -> None:
    """Remove every rule a campaign made (one killed mid-partition leaves its rules behind)."""
    saved = subprocess.run(["iptables", "-S", "INPUT"], capture_output=True, text=True).stdout.splitlines()
    for line in saved:
        if TAG in line and line.startswith("-A "):
            subprocess.run(["iptables", "-D", *line.split()[1:]], check=False)
