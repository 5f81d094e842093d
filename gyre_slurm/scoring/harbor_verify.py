"""A Harbor task's verifier as an evaluator: `python -m gyre_slurm.scoring.harbor_verify TASK_DIR WORKSPACE`.

Runs TASK_DIR/tests/test.sh with bash in bubblewrap, where Harbor's tests expect things to be:
  /app    the workspace, writable, and the working folder (Terminal-Bench's agent folder);
  /tests  the task's tests/, read-only;
  /logs   a fresh, empty folder (logs/verifier/ made), writable: test.sh writes its reward to
          /logs/verifier/reward.txt (one number) or reward.json ({"reward": x, ...}).
Around them only the system's folders (/usr, /etc, /opt, the /bin and /lib links…), read-only, a private /tmp and
new PID, IPC and UTS namespaces (a network namespace with loopback only where bubblewrap can make one), and no
capabilities even when the worker runs as root (else a remount would make the view writable). The policy's
workspace is untrusted: nothing it left elsewhere (its HOME, /tmp, /var/tmp, the run's state folder) is visible to
test.sh, and test.sh writes nothing but the workspace and the logs folder. The environment is a fixed minimal one
(no variable of the worker's gets in: no keys). test.sh gets [verifier] timeout_sec (task.toml).

Then the reward (reward.json's "reward" when it exists, as Harbor prefers, else reward.txt) is printed as the last
line of stdout; test.sh's own output goes to stderr. A missing reward, a non-number, one outside [0, 1], a timeout,
no bubblewrap: exit 1 with one line on stderr saying which. That is an evaluator error (scoring/evaluator.py): the
run is excluded from its group, never scored 0. test.sh's exit status is not read, as in Harbor.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from gyre_slurm.errors import GyreError
from gyre_slurm.harness.harbor import TEST_SCRIPT, verifier_timeout_s
from gyre_slurm.harness.sandbox import make_sandbox

APP, TESTS, LOGS = "/app", "/tests", "/logs"
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/nix")
ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
       "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
MAX_REWARD_BYTES = 64 * 1024


class VerifyError(GyreError):
    """The verifier gave no valid reward; the message is the one line printed on stderr."""


def _system_view() -> list[str]:
    """Read-only binds of the system's folders (symlinks, as merged-/usr systems have, stay symlinks)."""
    out: list[str] = []
    for p in SYSTEM:
        if os.path.islink(p):
            out += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            out += ["--ro-bind", p, p]
    return out


def bwrap_argv(bwrap: str, workspace: Path, tests: Path, logs: Path, own_network: bool) -> list[str]:
    """bubblewrap's argv that runs test.sh; only the workspace and `logs` are writable."""
    argv = [bwrap, *_system_view(), "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/var/tmp",
            "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--new-session", "--die-with-parent",
            "--cap-drop", "ALL"]  # a worker running as root: no capability to remount the read-only view writable
    if own_network:
        argv.append("--unshare-net")
    argv += ["--bind", str(workspace), APP, "--ro-bind", str(tests), TESTS, "--bind", str(logs), LOGS,
             "--remount-ro", "/", "--chdir", APP, "--", "bash", f"{TESTS}/test.sh"]
    return argv


def _sandbox() -> tuple[str, bool]:
    """(bwrap's path, whether it can make a network namespace). Raises VerifyError where it cannot run."""
    if shutil.which("bwrap") is None:
        raise VerifyError("bubblewrap (bwrap) is not installed: Harbor tests run only in its sandbox "
                          "(Debian: apt-get install bubblewrap)")
    sb = make_sandbox("auto", "proxy-only")
    if sb.kind != "bwrap" or sb.bwrap is None:
        raise VerifyError(f"bubblewrap cannot start a sandbox here: {sb.why.removeprefix('NO SANDBOX: ')}")
    return sb.bwrap, sb.own_network


def _read_regular(folder: int, name: str) -> str | None:
    """A reward file's text, or None if there is none. Never follows a symlink (test.sh runs the policy's code,
    which could point the file at one of this machine's) and never waits on a FIFO."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise VerifyError(f"/logs/verifier/{name} cannot be read ({e.strerror}; a symlink is refused)") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise VerifyError(f"/logs/verifier/{name} is not a regular file")
        data = f.read(MAX_REWARD_BYTES + 1)
    if len(data) > MAX_REWARD_BYTES:
        raise VerifyError(f"/logs/verifier/{name} is over {MAX_REWARD_BYTES} bytes: not a reward")
    return data.decode(errors="replace")


def _short(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= 40 else text[:40] + "…")


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise VerifyError(f"{where} is not a number: {_short(repr(value))}")
    try:
        x = float(value)
    except ValueError:
        raise VerifyError(f"{where} is not a number: {_short(str(value))}") from None
    if math.isnan(x) or not 0.0 <= x <= 1.0:
        raise VerifyError(f"{where} is {x:g}, outside [0, 1]")
    return x


def _from_json(text: str) -> float:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        raise VerifyError(f"/logs/verifier/reward.json is not valid JSON: {_short(text)}") from None
    if not isinstance(data, dict):
        raise VerifyError("/logs/verifier/reward.json is not a JSON object")
    if "reward" in data:
        return _number(data["reward"], "reward.json's 'reward'")
    if len(data) == 1:  # one named reward: that is the score
        (key, value), = data.items()
        return _number(value, f"reward.json's {key!r}")
    raise VerifyError(f"/logs/verifier/reward.json has no 'reward' among {len(data)} values")


def read_reward(logs: Path, exit_code: int) -> float:
    """The reward test.sh wrote under `logs` (the folder bound at /logs). Raises VerifyError saying what is wrong."""
    try:
        folder = os.open(logs / "verifier", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        raise VerifyError("/logs/verifier is gone or no longer a folder: test.sh wrote no reward") from None
    try:
        text = _read_regular(folder, "reward.json")
        if text is not None:
            return _from_json(text)
        text = _read_regular(folder, "reward.txt")
    finally:
        os.close(folder)
    if text is None:
        raise VerifyError(f"test.sh (exit {exit_code}) wrote no reward: neither /logs/verifier/reward.txt nor "
                          "reward.json")
    if not text.strip():
        raise VerifyError("/logs/verifier/reward.txt is empty")
    return _number(text.strip(), "/logs/verifier/reward.txt")


def verify(task_dir: Path, workspace: Path) -> float:
    """Run the task's test.sh on the workspace and return its reward."""
    task_dir, workspace = Path(task_dir).resolve(), Path(workspace).resolve()
    tests = task_dir / Path(TEST_SCRIPT).parent
    if not (task_dir / TEST_SCRIPT).is_file():
        raise VerifyError(f"{task_dir / TEST_SCRIPT} not found: not a Harbor task folder")
    if not workspace.is_dir():
        raise VerifyError(f"workspace {workspace} is not a folder")
    timeout_s = verifier_timeout_s(task_dir)
    bwrap, own_network = _sandbox()
    logs = Path(tempfile.mkdtemp(prefix="gyre-harbor-logs-"))  # fresh: nothing in it but what test.sh writes
    try:
        (logs / "verifier").mkdir()
        (logs / "agent").mkdir()
        argv = bwrap_argv(bwrap, workspace, tests, logs, own_network)
        sys.stderr.flush()
        try:  # test.sh's output to stderr: stdout carries the score alone
            r = subprocess.run(argv, env=ENV, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
                               stderr=sys.stderr.fileno(), timeout=timeout_s)
        except subprocess.TimeoutExpired:  # bwrap is killed; --die-with-parent and the PID namespace take the rest
            raise VerifyError(f"test.sh timed out after {timeout_s:g} s ([verifier] timeout_sec)") from None
        return read_reward(logs, r.returncode)
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m gyre_slurm.scoring.harbor_verify TASK_DIR WORKSPACE", file=sys.stderr)
        return 2
    try:
        reward = verify(Path(argv[0]), Path(argv[1]))
    except GyreError as e:  # VerifyError, or a ConfigError of task.toml
        print(f"harbor_verify: {e}", file=sys.stderr)
        return 1
    print(reward)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
