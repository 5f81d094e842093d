"""The image sandbox's first process: `python -m gyre_slurm.harness.jail SPEC.json`, run by the worker for a harness
or an evaluator whose task names a container image (harness/image_runtime.py writes the spec).

It runs on the host, as the worker's user, and prepares in namespaces of its own what bubblewrap or podman then
enters:
  1. a mount and a network namespace (as a user that is not root, in a user namespace of its own first: no root
     is needed where user namespaces are allowed);
  2. the network: only `lo`, and, for a harness, a relay listening on 127.0.0.1:RELAY_PORT that hands each
     connection to the worker's proxy bridge (a Unix socket, reached by its path: the jail still sees the host's
     files): no daemon port, no other host, no other run. An evaluator gets no relay;
  3. the root: the image's root file system (shared read-only by every run on the node) under an overlay whose
     writable part is a small tmpfs, so that bubblewrap or podman can make their mount points in it; it is
     read-only again inside the sandbox;
  4. the workspace: an overlay on the image's working folder whose changes go to the run's own `upper` folder —
     disk in proportion to what the run changes, not to the image. An evaluator's copy stacks the run's changes
     as a read-only layer under a fresh `upper` of its own, so nothing it does changes the run's workspace;
  5. limits: a control group with the run's CPU, memory and process limits (harness/cgroups.py), else resource
     limits; RLIMIT_FSIZE and a watch on the size of `upper` for the disk.
Then it starts the runtime (bwrap or podman), waits, and exits with its status. A limit the run runs into (the
OOM killer, fork() refused, `upper` past its size) ends the whole run: the jail writes what happened to
`limit_report` and exits 137. SIGTERM is passed on; the jail dies with the worker (PR_SET_PDEATHSIG), and the
sandbox with it (bwrap's --die-with-parent; podman: the container is killed).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gyre_slurm.harness import namespaces as ns
from gyre_slurm.harness.cgroups import Group, RunLimits, group_of, make_group
from gyre_slurm.harness.netrelay import RELAY_PORT, relay_to_socket

LIMIT_EXIT = 137
WATCH_S = 0.25
DISK_WATCH_S = 0.5
ROOT_LAYER_MB = 64  # the root's writable part: mount points only (the root is read-only inside)


@dataclass(frozen=True)
class Bind:
    src: str
    dest: str
    ro: bool = True


@dataclass(frozen=True)
class JailSpec:
    """What one sandboxed process gets (written by harness/image_runtime.py, read here). Standard library only, like
    the rest of the jail: it starts in a few hundredths of a second, and on any Python 3 (a node's own)."""

    runtime: str  # "bwrap" or "podman"
    name: str  # unique on the node: the control group's and the container's name
    rootfs: str  # the image's root file system on the host (read-only, shared)
    workdir: str  # the workspace inside the image (absolute)
    upper: str  # where this process's changes to the workspace go
    overlay_work: str  # overlayfs's work folder: empty, on the same file system as `upper`
    env: dict[str, str]
    argv: list[str]
    limit_report: str
    program: list[str]  # bwrap's path, or podman's argv start (with its options)
    layers: list[str] = field(default_factory=list)  # read-only layers over the image's workdir, the first on top
    binds: list[Bind] = field(default_factory=list)
    proxy_socket: str | None = None  # the worker's proxy bridge: relayed to 127.0.0.1:relay_port inside
    relay_port: int = RELAY_PORT
    limits: RunLimits = RunLimits()
    dropped_caps: list[str] = field(default_factory=list)
    program_env: dict[str, str] = field(default_factory=dict)  # added to podman's environment (its containers.conf)
    timeout_s: float | None = None  # podman: the container's own limit (a worker killed with -9 leaves none)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> JailSpec:
        """Raises ValueError (or TypeError) on a spec that is not one."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("runtime") not in ("bwrap", "podman"):
            raise ValueError("not a jail spec")
        data["binds"] = [Bind(**b) for b in data.get("binds", [])]
        data["limits"] = RunLimits(**data.get("limits", {}))
        return cls(**data)


def _disk_bytes(folder: Path) -> int:
    total = 0
    stack = [str(folder)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += st.st_blocks * 512
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
        except OSError:
            continue
    return total


def _bwrap_argv(spec: JailSpec, root: str) -> list[str]:
    wd = spec.workdir
    argv = [spec.program[0], "--bind", root, "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    for b in spec.binds:
        argv += ["--ro-bind" if b.ro else "--bind", b.src, b.dest]
    # the root read-only again; the workspace (a mount of its own under it) writable
    argv += ["--remount-ro", "/", "--bind", f"{root}{wd}", wd,
             "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
             *(a for cap in spec.dropped_caps for a in ("--cap-drop", cap)), "--chdir", wd, "--", *spec.argv]
    return argv


def _podman_argv(spec: JailSpec, root: str, env_file: str) -> list[str]:
    wd = spec.workdir
    argv = [*spec.program, "run", "--rm", "--name", spec.name, "--read-only",
            "--network", "host",  # the jail's own network namespace: lo and the relay, nothing else
            "--volume", f"{root}{wd}:{wd}", "--workdir", wd, "--env-file", env_file, "--user", "0:0",
            "--security-opt", "no-new-privileges", "--log-driver", "none", "--pull", "never",
            *(a for cap in spec.dropped_caps for a in ("--cap-drop", cap))]
    for b in spec.binds:
        argv += ["--volume", f"{b.src}:{b.dest}:{'ro' if b.ro else 'rw'}"]
    # podman makes the container's group itself, with the same limits; the jail watches that group for breaches
    lim = spec.limits
    argv += [*(["--memory", f"{lim.memory_mb}m", "--memory-swap", f"{lim.memory_mb}m"] if lim.memory_mb else []),
             *(["--pids-limit", str(lim.processes)] if lim.processes else []),
             *(["--cpus", f"{lim.cpus:g}"] if lim.cpus else [])]
    if spec.timeout_s:
        argv += ["--timeout", str(int(spec.timeout_s) + 60)]
    # the root file system takes the image's place; podman takes the rest as the command, options and all
    return [*argv, "--rootfs", root, *spec.argv]


def _prepare_root(spec: JailSpec, scratch: str, userxattr: bool) -> str:
    """Mount the root and the workspace (see the module's docstring); returns the root's folder."""
    ns.tmpfs(scratch, ROOT_LAYER_MB)
    for d in ("rl-upper", "rl-work", "root", "empty"):
        os.mkdir(f"{scratch}/{d}")
    root = f"{scratch}/root"
    ns.overlay([spec.rootfs], f"{scratch}/rl-upper", f"{scratch}/rl-work", root, userxattr)
    image_wd = os.path.join(spec.rootfs, spec.workdir.lstrip("/"))
    base = image_wd if os.path.isdir(image_wd) and not os.path.islink(image_wd) else f"{scratch}/empty"
    target = f"{root}{spec.workdir}"
    os.makedirs(target, exist_ok=True)
    ns.overlay([*spec.layers, base], spec.upper, spec.overlay_work, target, userxattr)
    return root


def _rlimits(spec: JailSpec, grouped: bool) -> None:
    """RLIMIT_FSIZE for the disk; memory and processes too where no group holds them (podman's flags do there)."""
    lim = spec.limits
    if lim.disk_mb is not None:  # a single file past the disk limit is refused at once (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.disk_mb * 2**20,) * 2)
    if not grouped:
        if lim.memory_mb is not None:
            resource.setrlimit(resource.RLIMIT_AS, (lim.memory_mb * 2**20,) * 2)
        if lim.processes is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (lim.processes,) * 2)


class _Child:
    """bwrap, or podman's client: what the jail started."""

    def __init__(self, spec: JailSpec, argv: list[str], env: dict[str, str]) -> None:
        self.spec = spec
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
        self._podman_env = {**os.environ, **spec.program_env}

    def container_group(self) -> Group | None:
        """podman: the container's control group, once it runs (None before, and for bwrap)."""
        if self.spec.runtime != "podman":
            return None
        r = subprocess.run([*self.spec.program, "inspect", "--format", "{{.State.Pid}}", self.spec.name],
                           env=self._podman_env, capture_output=True, text=True, timeout=30)
        pid = r.stdout.strip()
        return group_of(int(pid)) if r.returncode == 0 and pid.isdigit() and int(pid) > 0 else None

    def kill(self, detached: bool = False) -> None:
        if self.spec.runtime == "podman":  # the container is conmon's child, not ours: podman removes it
            argv = [*self.spec.program, "rm", "--force", "--time", "0", self.spec.name]
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                if detached:  # on SIGTERM: the worker kills our whole group 2 s later, this must outlive it
                    subprocess.Popen(argv, env=self._podman_env, start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    return
                subprocess.run(argv, env=self._podman_env, capture_output=True, timeout=60)
        with contextlib.suppress(OSError):
            self.proc.kill()


def run(spec: JailSpec, scratch: str) -> int:
    ns.die_with_parent()
    userxattr = ns.enter_own_namespaces(network=True)
    ns.loopback_up()
    root = _prepare_root(spec, scratch, userxattr)
    group = None  # bwrap: the run's own group; podman makes the container's itself
    if spec.runtime == "bwrap" and spec.limits.any_group_limit():
        group, _how = make_group(spec.name, spec.limits)
    if group is not None:
        group.join(os.getpid())  # the jail first: whatever it starts is in the group from its first instruction
    _rlimits(spec, group is not None or spec.runtime == "podman")
    if spec.proxy_socket:
        relay_to_socket(spec.relay_port, spec.proxy_socket)
    env = dict(spec.env)
    if spec.runtime == "bwrap":
        argv = _bwrap_argv(spec, root)
    else:
        env_file = f"{scratch}/env"
        with open(env_file, "w", opener=lambda p, f: os.open(p, f, 0o600)) as f:
            f.writelines(f"{k}={v}\n" for k, v in spec.env.items() if "\n" not in v)
        argv = _podman_argv(spec, root, env_file)
        env = {**os.environ, **spec.program_env}
    child = _Child(spec, argv, env)
    signal.signal(signal.SIGTERM, lambda _s, _f: child.kill(detached=True))
    breach = None
    next_disk = 0.0
    watched = group
    try:
        while child.proc.poll() is None:  # (an error of ours kills the child too: nothing outlives the jail)
            try:
                child.proc.wait(WATCH_S)  # back at once when it ends
                break
            except subprocess.TimeoutExpired:
                pass
            if watched is None and spec.runtime == "podman":
                watched = child.container_group()
            breach = watched.breach(spec.limits) if watched is not None else None
            now = time.monotonic()
            if breach is None and spec.limits.disk_mb is not None and now >= next_disk:
                used = _disk_bytes(Path(spec.upper))
                if used > spec.limits.disk_mb * 2**20:
                    breach = f"disk limit ({spec.limits.disk_mb} MB of changes): the workspace held {used >> 20} MB"
                next_disk = now + DISK_WATCH_S
            if breach is not None:
                child.kill()
                break
        code = child.proc.wait()
    finally:
        rc = child.proc.poll()
        # podman: a client that died or failed itself (125 and up) may leave its container; --rm removed the others
        if rc is None or (spec.runtime == "podman" and breach is None and (rc < 0 or rc >= 125)):
            child.kill()
        if group is not None:
            group.remove()
    if breach is not None:
        Path(spec.limit_report).write_text(json.dumps({"limit": breach}) + "\n")
        return LIMIT_EXIT
    return code if code >= 0 else 128 - code


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m gyre_slurm.harness.jail SPEC.json", file=sys.stderr)
        return 2
    path = Path(argv[0])
    try:
        spec = JailSpec.from_json(path.read_text())
    except (OSError, ValueError, TypeError) as e:
        print(f"jail: cannot read {path}: {e}", file=sys.stderr)
        return 126
    try:
        return run(spec, str(path.parent / "mnt"))
    except OSError as e:
        print(f"jail: {e.strerror or e}", file=sys.stderr)
        return 126


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
