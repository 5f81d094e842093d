"""The few Linux calls the image sandbox makes itself (harness/jail.py), through libc: Python 3.10 and 3.11 have
no os.unshare, and the standard library has no mount(2).

Everything here acts on the calling process only, and is only called by the jail process before it starts any
thread: unshare(CLONE_NEWUSER) refuses a multi-threaded caller.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import socket
import struct

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


class NamespaceError(OSError):
    pass


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise NamespaceError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def mount(source: str, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    _check(_libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                       data.encode() if data is not None else None), f"mount {fstype or 'bind'} on {target}")


def die_with_parent() -> None:
    """SIGKILL when the parent (the worker) dies: a killed worker leaves no jail behind."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def enter_own_namespaces(network: bool) -> bool:
    """A mount namespace of our own (and a network namespace, when `network`), and as a user that is not root a
    user namespace first, in which this user is root (so it may mount: overlayfs in a user namespace needs Linux
    5.11). Mounts made from here on are seen by this process and its children only. Returns whether a user
    namespace was made (overlayfs then takes its `userxattr` option)."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | (CLONE_NEWNET if network else 0)
    as_user = uid != 0
    if as_user:
        unshare(flags | CLONE_NEWUSER)
        with open("/proc/self/setgroups", "w") as f:  # required before an unprivileged gid_map
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"0 {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"0 {gid} 1")
    else:
        unshare(flags)
    mount("none", "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates back to the machine
    return as_user


def loopback_up() -> None:
    """Bring `lo` up in this (new) network namespace: it starts down, with nothing listening or reachable."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


def overlay(lower: list[str], upper: str | None, work: str | None, target: str, userxattr: bool) -> None:
    """overlayfs on `target`: `lower` folders, the first on top; with `upper`/`work` writable (changes go to
    `upper`), without them read-only. Folder names may not hold ',' or ':' (the option syntax)."""
    for p in [*lower, upper or "", work or ""]:
        if "," in p or ":" in p:
            raise NamespaceError(0, f"overlay folder {p!r} holds ',' or ':'")
    opts = f"lowerdir={':'.join(lower)}"
    if upper is not None:
        opts += f",upperdir={upper},workdir={work}"
    if userxattr:
        opts += ",userxattr"
    mount("overlay", target, "overlay", 0 if upper is not None else MS_RDONLY, opts)


def tmpfs(target: str, size_mb: int, mode: int = 0o755) -> None:
    mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,mode={mode:o}")
