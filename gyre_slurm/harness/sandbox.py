"""The harness's sandbox: the policy under training writes and runs code, so its harness sees its own workspace and
nothing of the run around it.

With bubblewrap (`harness.sandbox: bwrap`, or `auto` where `bwrap` works) the harness runs in new mount, PID, IPC
and UTS namespaces over a read-only view of the machine (system and interpreter folders, the installed CLIs):
  - the state folder is an empty tmpfs: no control.json (the run token), no ledger, no config, no other run's or
    rollout's workspace; only the harness CLIs' install folder (state/harness) comes back, read-only;
  - the folders of the task's evaluator (the paths its argv names, outside the system and interpreter folders) are
    empty tmpfs too, so its hidden tests can be neither read nor edited; the evaluator itself runs afterwards,
    outside the sandbox;
  - its own workspace is the one writable folder, and /tmp a private tmpfs; every other write fails (EROFS), in
    the hidden folders too (they are empty and read-only);
  - with `harness.network: proxy-only` (the default), a network namespace of its own: loopback only, and its
    proxy through a relay (harness/netrelay.py); the daemon's port and every other host are out of reach.
Resource limits (address space, processes, open files) apply to every harness, sandboxed or not. Where bubblewrap
cannot run (`auto`), harnesses run unsandboxed and the run says so when it starts (log and `events`).
"""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gyre_slurm.errors import GyreError
from gyre_slurm.harness.netrelay import SOCKET_IN_SANDBOX

# never hidden: what programs need to run (the evaluator's interpreter is also the harness's)
SYSTEM = tuple(Path(p) for p in ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/opt", "/var", "/nix"))
# A worker running as root would keep every capability inside bubblewrap: `umount` of the hidden state folder would
# show the run token, a remount would make the system writable, open_by_handle_at reads any file of a disk, a device
# node or a module reaches the machine. These go; the rest stay, for a CLI's own sandbox (Codex's exec sandbox
# stops working without them all: every command it runs fails).
DROPPED_CAPS = ("CAP_SYS_ADMIN", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_DAC_READ_SEARCH", "CAP_MKNOD",
                "CAP_SYS_PTRACE", "CAP_SYS_BOOT", "CAP_SYS_TIME", "CAP_BPF", "CAP_PERFMON", "CAP_SYSLOG",
                "CAP_LINUX_IMMUTABLE", "CAP_MAC_ADMIN", "CAP_MAC_OVERRIDE", "CAP_AUDIT_CONTROL", "CAP_SYS_PACCT")
HARNESS_INSTALLS = "harness"  # state/harness: the CLIs `gyre harness install` put there (harness/install.py)


@dataclass(frozen=True)
class Limits:
    memory_mb: int | None = None  # RLIMIT_AS
    processes: int | None = None  # RLIMIT_NPROC (per user: root is not held to it)
    open_files: int | None = None  # RLIMIT_NOFILE

    def preexec(self) -> Callable[[], None] | None:
        pairs = [(resource.RLIMIT_AS, self.memory_mb and self.memory_mb * 2**20),
                 (resource.RLIMIT_NPROC, self.processes), (resource.RLIMIT_NOFILE, self.open_files)]
        pairs = [(k, v) for k, v in pairs if v]
        if not pairs:
            return None

        def apply() -> None:  # in the child, before exec: the harness and everything it starts
            for k, v in pairs:
                resource.setrlimit(k, (v, v))
        return apply


@dataclass(frozen=True)
class Sandbox:
    kind: str  # "bwrap" or "none"
    why: str  # how harnesses run, in one line (for the log and the ledger)
    bwrap: str | None = None
    own_network: bool = False  # a network namespace whose one way out is the proxy (harness/netrelay.py)

    def wrap(self, argv: list[str], workspace: Path, state_dir: Path, evaluator: list[str],
             proxy_socket: Path | None = None) -> list[str]:
        """argv as the sandbox runs it in `workspace` (unchanged without a sandbox). With its own network, the
        relay to `proxy_socket` (a ProxyBridge's) runs first inside and starts the harness."""
        if self.bwrap is None:
            return list(argv)
        ws, state = Path(workspace).resolve(), Path(state_dir).resolve()
        out = [self.bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
               "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
               *(arg for cap in DROPPED_CAPS for arg in ("--cap-drop", cap))]
        if self.own_network:
            if proxy_socket is None:
                raise GyreError("a sandbox with its own network needs the proxy bridge's socket")
            out += ["--unshare-net", "--bind", str(proxy_socket), SOCKET_IN_SANDBOX]
            argv = [sys.executable, "-m", "gyre_slurm.harness.netrelay", "--", *argv]
        for p in _needed_under_tmp():  # a checkout or venv under /tmp must stay visible (read-only) in the private /tmp
            out += ["--ro-bind", str(p), str(p)]
        hidden = [state, *evaluator_folders(evaluator, ws, state)]
        for folder in hidden:
            out += ["--tmpfs", str(folder)]
        if (state / HARNESS_INSTALLS).is_dir():
            out += ["--ro-bind", str(state / HARNESS_INSTALLS), str(state / HARNESS_INSTALLS)]
        out += ["--bind", str(ws), str(ws)]
        for folder in hidden:  # after the mount points inside them are made: empty, and not writable either
            out += ["--remount-ro", str(folder)]
        return [*out, "--chdir", str(ws), "--", *argv]


def _needed_under_tmp() -> list[Path]:
    """The interpreter's and this package's folders that lie under /tmp (e.g. a checkout in /tmp): the harness
    needs them, and the private /tmp would hide them. The state folder is hidden again after them."""
    tmp = Path("/tmp").resolve()
    out: list[Path] = []
    for p in (Path(sys.prefix), Path(sys.base_prefix), Path(__file__).resolve().parents[2]):
        p = p.resolve()
        if p.is_relative_to(tmp) and p != tmp and not any(p.is_relative_to(q) for q in out):
            out.append(p)
    return out


def evaluator_folders(evaluator: list[str], workspace: Path, state_dir: Path) -> list[Path]:
    """The folders of the files the evaluator's argv names: hidden from the harness. Not the system's, the
    interpreter's or this package's (the harness needs them to run), and never one that holds the workspace."""
    keep = [*SYSTEM, Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), Path(__file__).resolve().parents[1]]
    out: list[Path] = []
    for arg in evaluator:
        p = Path(arg)
        if not p.is_absolute() or not p.exists():
            continue
        folder = (p if p.is_dir() else p.parent).resolve()
        if any(folder == k or folder.is_relative_to(k) for k in keep) or workspace.is_relative_to(folder) \
                or folder.is_relative_to(workspace) or folder == state_dir or folder in out:
            continue
        out.append(folder)
    return out


def bwrap_works(bwrap: str, *extra: str) -> str | None:
    """None if a trivial sandbox starts here, else why not (no user namespaces, a seccomp profile…)."""
    try:
        r = subprocess.run([bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid",
                            *extra, "--die-with-parent", "true"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]


def make_sandbox(mode: str, network: str = "proxy-only") -> Sandbox:
    """The sandbox `harness.sandbox` and `harness.network` ask for, as this node can give it; `bwrap` that cannot be
    had is an error."""
    if mode == "none":
        return Sandbox("none", "harnesses run unsandboxed (harness.sandbox: none): they can read the run folder")
    bwrap = shutil.which("bwrap")
    why = "bwrap is not installed (Debian: apt-get install bubblewrap)" if bwrap is None else bwrap_works(bwrap)
    if why is None:
        seen = f"harnesses run in bubblewrap ({bwrap}): they see their own workspace only"
        if network == "host":
            return Sandbox("bwrap", f"{seen}; the network is the host's (harness.network: host)", bwrap)
        no_net = bwrap_works(bwrap, "--unshare-net")
        if no_net is None:
            return Sandbox("bwrap", f"{seen}, and reach nothing but their proxy", bwrap, own_network=True)
        if mode == "bwrap":
            raise GyreError(f"harness.network is proxy-only, but bwrap cannot make a network namespace: {no_net}")
        return Sandbox("bwrap", f"{seen}; NO NETWORK ISOLATION: {no_net} (the daemon's port is reachable)", bwrap)
    if mode == "bwrap":
        raise GyreError(f"harness.sandbox is bwrap, but {why}")
    return Sandbox("none", f"NO SANDBOX: {why}; harnesses run as this user and can read the run folder "
                           "(control.json, the ledger, other workspaces)")
