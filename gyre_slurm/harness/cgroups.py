"""Per-run resource limits through a control group: CPU cores, memory and processes of one run together, whatever
it starts (an image run, harness/jail.py).

A run's group is made below the worker's own group (so a Slurm job's limits still hold around it):
  - cgroup v1 (this machine: hybrid, /sys/fs/cgroup/{cpu,memory,pids}): one folder in each controller's
    hierarchy; making it needs write access there (root, or a delegated subtree);
  - cgroup v2: a child of the worker's group, which needs the group delegated to the worker's user with the cpu,
    memory and pids controllers already enabled in its cgroup.subtree_control (systemd's Delegate=yes); a
    process cannot enable them on its own group while it lives in it.
Where neither can be had, `make_group` says why and the caller falls back to resource limits (RLIMIT_AS for
memory, RLIMIT_NPROC for processes, nothing for CPU): see `how_limits_apply`.

At a limit: CPU is throttled (the run goes on, slower); memory beyond the limit makes the kernel's OOM killer end
a process of the run; processes beyond the limit make fork() fail. Either of the last two is a breach
(`Group.breach`): the jail then ends the whole run, which is scored from its workspace like a run that timed out,
since it was the policy's doing.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

CPU_PERIOD_US = 100_000
_V1_CONTROLLERS = ("cpu", "memory", "pids")


@dataclass(frozen=True)
class RunLimits:
    cpus: float | None = None  # cores
    memory_mb: int | None = None  # the run's processes together (page cache and its /tmp included)
    processes: int | None = None  # processes and threads at once
    disk_mb: int | None = None  # its writable layer (jail.py watches it; RLIMIT_FSIZE caps a single file)

    def any_group_limit(self) -> bool:
        return any(v is not None for v in (self.cpus, self.memory_mb, self.processes))


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _counter(text: str, key: str) -> int:
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key and parts[1].isdigit():
            return int(parts[1])
    return 0


@dataclass
class Group:
    version: int
    folders: dict[str, Path]  # controller ("cpu", "memory", "pids"; v2: "" for the one folder) → its folder

    def join(self, pid: int) -> None:
        for folder in dict.fromkeys(self.folders.values()):
            (folder / "cgroup.procs").write_text(str(pid))

    def _file(self, controller: str, name: str) -> Path:
        return self.folders.get(controller, self.folders.get("", Path("/nonexistent"))) / name

    def _count(self, controller: str, name: str, key: str) -> int:
        """A counter summed over the group and the groups below it (podman puts its container in one: cgroup v1
        counts a refused fork where it was tried, not where the limit is)."""
        top = self._file(controller, name).parent
        return sum(_counter(_read(Path(folder) / name), key) for folder, _dirs, _files in os.walk(top))

    def oom_kills(self) -> int:
        return self._count("memory", "memory.oom_control" if self.version == 1 else "memory.events", "oom_kill")

    def fork_refusals(self) -> int:
        return self._count("pids", "pids.events", "max")

    def breach(self, limits: RunLimits) -> str | None:
        """What limit the run has run into, in words, or None."""
        if limits.memory_mb is not None and self.oom_kills():
            return f"memory limit ({limits.memory_mb} MB): the kernel's OOM killer ended a process of the run"
        if limits.processes is not None and self.fork_refusals():
            return f"process limit ({limits.processes}): fork() was refused"
        return None

    def remove(self) -> None:
        """Remove the group: this process moves back to the group above, what is still in it is killed."""
        for folder in dict.fromkeys(self.folders.values()):
            with contextlib.suppress(OSError):
                (folder.parent / "cgroup.procs").write_text(str(os.getpid()))
        for top in dict.fromkeys(self.folders.values()):
            for folder, _dirs, _files in sorted(os.walk(top), key=lambda w: -len(w[0])):  # the deepest first
                for pid in _read(Path(folder) / "cgroup.procs").split():
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), 9)
                for _ in range(50):  # a killed process leaves its group a moment later
                    try:
                        os.rmdir(folder)
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        time.sleep(0.02)


def _own_paths() -> dict[str, str]:
    """/proc/self/cgroup: controller → this process's group path ("" for the v2 hierarchy)."""
    out: dict[str, str] = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _id, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _mounts() -> dict[str, Path]:
    """controller → where its hierarchy is mounted ("" → the cgroup2 mount)."""
    out: dict[str, Path] = {}
    for line in _read(Path("/proc/mounts")).splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        if parts[2] == "cgroup2":
            out.setdefault("", Path(parts[1]))
        elif parts[2] == "cgroup":
            for opt in parts[3].split(","):
                if opt in _V1_CONTROLLERS:
                    out.setdefault(opt, Path(parts[1]))
    return out


def group_of(pid: int) -> Group | None:
    """The group a process is in (a podman container's: podman made it), to watch for breaches; not ours to remove."""
    mounts, folders = _mounts(), {}
    for line in _read(Path(f"/proc/{pid}/cgroup")).splitlines():
        _id, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            if c in mounts and (c == "" or c in _V1_CONTROLLERS):
                folders[c] = mounts[c] / path.lstrip("/")
    if all(c in folders for c in _V1_CONTROLLERS):
        return Group(1, {c: folders[c] for c in _V1_CONTROLLERS})
    return Group(2, {"": folders[""]}) if "" in folders else None


def _limit_files(limits: RunLimits, version: int) -> list[tuple[str, str, str]]:
    """(controller, file, value) to write."""
    out: list[tuple[str, str, str]] = []
    if limits.memory_mb is not None:
        b = str(limits.memory_mb * 2**20)
        out += [("memory", "memory.limit_in_bytes", b)] if version == 1 else [("memory", "memory.max", b),
                                                                                ("memory", "memory.swap.max", "0")]
    if limits.processes is not None:
        out.append(("pids", "pids.max", str(limits.processes)))
    if limits.cpus is not None:
        quota = max(1000, int(limits.cpus * CPU_PERIOD_US))
        out += [("cpu", "cpu.cfs_period_us", str(CPU_PERIOD_US)), ("cpu", "cpu.cfs_quota_us", str(quota))] \
            if version == 1 else [("cpu", "cpu.max", f"{quota} {CPU_PERIOD_US}")]
    return out


def _needed(limits: RunLimits) -> list[str]:
    return [c for c, v in (("cpu", limits.cpus), ("memory", limits.memory_mb), ("pids", limits.processes))
            if v is not None]


def make_group(name: str, limits: RunLimits) -> tuple[Group | None, str]:
    """A group with the run's limits, or (None, why not). `name` is unique on the node (the rollout's)."""
    needed = _needed(limits)
    if not needed:
        return None, "no CPU, memory or process limit set"
    mounts, own = _mounts(), _own_paths()
    if all(c in mounts for c in needed):
        version, folders = 1, {c: mounts[c] / own.get(c, "/").lstrip("/") / f"gyre-{name}" for c in needed}
    elif "" in mounts:
        base = mounts[""] / own.get("", "/").lstrip("/")
        enabled = _read(base / "cgroup.subtree_control").split()
        missing = [c for c in needed if c not in enabled]
        if missing:
            return None, (f"cgroup v2 group {base} does not delegate {', '.join(missing)} (its "
                          "cgroup.subtree_control)")
        version, folders = 2, {"": base / f"gyre-{name}"}
    else:
        return None, "no cgroup hierarchy with the cpu, memory and pids controllers is mounted"
    group = Group(version, folders)
    try:
        for folder in dict.fromkeys(folders.values()):
            folder.mkdir(exist_ok=True)
        for controller, fname, value in _limit_files(limits, version):
            group._file(controller, fname).write_text(value)
    except OSError as e:
        group.remove()
        return None, f"cgroup v{version}: {e.strerror or e} ({getattr(e, 'filename', '') or ''})"
    return group, f"cgroup v{version}"


def how_limits_apply(limits: RunLimits, group_how: str, grouped: bool) -> dict[str, str]:
    """Each set limit → the mechanism that enforces it here, for the run's log and `events`."""
    out: dict[str, str] = {}
    if limits.cpus is not None:
        out["cpus"] = f"{group_how} (CPU quota)" if grouped else f"not enforced ({group_how})"
    if limits.memory_mb is not None:
        out["memory"] = group_how if grouped else f"RLIMIT_AS per process ({group_how})"
    if limits.processes is not None:
        out["processes"] = group_how if grouped else f"RLIMIT_NPROC of the user ({group_how})"
    if limits.disk_mb is not None:
        out["disk"] = "the writable layer's size, watched each 0.5 s, and RLIMIT_FSIZE per file"
    return out
