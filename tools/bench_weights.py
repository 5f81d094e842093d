"""Benchmark moving a policy version from the core to its receivers (rollout engines, satellites).

    .venv/bin/python tools/bench_weights.py [--size-mib 1024] [--receivers 3] [--rounds 3] [--bucket-mib 64]

One core (this process) and --receivers receiver processes, each with its own Mooncake Transfer Engine, on this
machine over TCP. Every round moves the whole state to all receivers at once, these ways, in rotating order:
- ours: `WeightPublisher` → `WeightPuller.pull` (transfer/weights.py) as a run does it with the default config:
  the handle, the slot header read before and after (the version checked at both ends), buckets read in batches,
  the tensors as named views;
- ours + verify (weights.verify: true): the same, every bucket's SHA-256 checked while the next batch is read;
- raw (the baseline): one `batch_transfer_sync_read` of the same bytes by each receiver, nothing checked;
- file: the core's safetensors snapshot loaded by each receiver (weights.transport: file). On one machine the
  file comes from the page cache; on a cluster it comes from the shared file system.
Reported per way: the time until the last receiver holds the state (median and range over the rounds) and the
aggregate GiB/s; the publisher's copy (+ digests) and the snapshot's write separately, and each path end to end
(core's part + receivers'). After timing, every receiver's bytes are checked against the core's (a mismatch fails
the run). The figure, last: ours/raw of the medians' aggregate throughput; the target is >= 0.8. Exits 1 when it
is missed.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_engine import Spread  # noqa: E402

TARGET = 0.8  # ours / raw aggregate throughput


def make_state(size_mib: int) -> dict:
    """A model-like state of about size_mib MiB: bf16 and fp32 matrices of mixed sizes, fixed seed."""
    import torch

    g = torch.Generator().manual_seed(0)
    state, left, i = {}, size_mib << 20, 0
    while left > 0:
        n = min(left, (48 << 20) if i % 3 else (16 << 20))
        dtype = torch.bfloat16 if i % 2 else torch.float32
        cols = 1024
        rows = max(1, n // (cols * torch.tensor([], dtype=dtype).element_size()))
        state[f"layers.{i}.weight"] = torch.randn(rows, cols, generator=g).to(dtype)
        left -= rows * cols * state[f"layers.{i}.weight"].element_size()
        i += 1
    return state


def receiver(conn, index: int) -> None:
    """A receiver process: answers ("ours", handle) / ("raw", peer, addr, n) / ("file", path) / ("digest",)."""
    import torch
    from safetensors.torch import load_file

    from gyre_slurm.protocol import WeightsHandle
    from gyre_slurm.transfer.engine import TransferAgent
    from gyre_slurm.transfer.weights import HEADER_BYTES, WeightPuller

    torch.set_num_threads(1)
    agent = TransferAgent()
    puller = WeightPuller(agent, f"bench:{index}")
    last = None
    conn.send(("ready", agent.peer))
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            return
        conn.recv()  # the start signal: every receiver begins together
        t0 = time.perf_counter()
        try:
            if cmd[0] == "ours":
                tensors, _ = puller.pull(WeightsHandle.model_validate_json(cmd[1]))
                last = ("ours", tensors)
            elif cmd[0] == "raw":
                _, peer, addr, n = cmd
                buf = puller._staging(HEADER_BYTES + n)
                agent.read(peer, [buf.data_ptr() + HEADER_BYTES], [addr + HEADER_BYTES], [n])
                last = ("raw", buf[HEADER_BYTES:HEADER_BYTES + n])
            elif cmd[0] == "file":
                last = ("file", load_file(cmd[1]))
            seconds = time.perf_counter() - t0
            conn.send(("done", seconds, _digest(last)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}", ""))


def _digest(last) -> str:
    import torch

    kind, data = last
    h = hashlib.sha256()
    if kind == "raw":
        h.update(memoryview(data.numpy()))
        return h.hexdigest()
    for name in sorted(data):
        t = data[name].contiguous()
        h.update(name.encode())
        h.update(memoryview(t.view(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def tensor_digest(state: dict) -> str:
    return _digest(("tensors", state))


def run_round(conns, cmd) -> tuple[float, list[str]]:
    """Send cmd to every receiver, start them together; the wall time until the last is done and their digests."""
    for c in conns:
        c.send(cmd)
    t0 = time.perf_counter()
    for c in conns:
        c.send("go")
    answers = [c.recv() for c in conns]
    wall = time.perf_counter() - t0
    bad = [a[1] for a in answers if a[0] != "done"]
    if bad:
        raise SystemExit(f"bench_weights: a receiver failed: {bad[0]}")
    return wall, [a[2] for a in answers]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024, help="size of the state moved (MiB)")
    ap.add_argument("--receivers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket-mib", type=int, default=64)
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    import torch
    from safetensors.torch import save_file

    from gyre_slurm.transfer.engine import TransferAgent
    from gyre_slurm.transfer.weights import WeightPublisher

    torch.set_num_threads(1)
    state = make_state(args.size_mib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    gib = nbytes / 2**30
    want = tensor_digest(state)
    agent = TransferAgent()
    pub = WeightPublisher(agent, bucket_bytes=args.bucket_mib << 20, verify=True)
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(args.receivers)]
    procs = [ctx.Process(target=receiver, args=(child, i), daemon=True) for i, (_, child) in enumerate(pipes)]
    for p in procs:
        p.start()
    conns = [parent for parent, _ in pipes]
    for c in conns:
        assert c.recv()[0] == "ready"
    print(f"state: {len(state)} tensors, {gib:.2f} GiB; {args.receivers} receivers; bucket {args.bucket_mib} MiB")
    ways = ["ours", "raw", "verified"]
    times: dict[str, list[float]] = {"ours": [], "raw": [], "verified": [], "file": []}
    publish_s, save_s = [], []
    with tempfile.TemporaryDirectory(prefix="gyre-bench-weights-") as tmp:
        snap = str(Path(tmp) / "model.safetensors")
        try:
            for r in range(args.rounds + 1):  # round 0 warms the connections up, untimed
                version = r + 1
                t0 = time.perf_counter()
                handle = pub.publish(version, list(state.items()))
                publish_s.append(time.perf_counter() - t0)
                for way in ways[r % 3:] + ways[:r % 3]:
                    if way == "raw":
                        cmd = ("raw", handle.peer, handle.addr, handle.nbytes)
                    else:
                        h = handle if way == "verified" else handle.model_copy(update={"digests": None})
                        cmd = ("ours", h.model_dump_json())
                    wall, digests = run_round(conns, cmd)
                    expect = want if way != "raw" else hashlib.sha256(
                        memoryview(pub._slots[version % 2][64:64 + handle.nbytes].numpy())).hexdigest()
                    if any(d != expect for d in digests):
                        raise SystemExit(f"bench_weights: a receiver's bytes differ from the core's ({way})")
                    if r:
                        times[way].append(wall)
                if r:
                    t0 = time.perf_counter()
                    save_file(state, snap)
                    save_s.append(time.perf_counter() - t0)
                    wall, digests = run_round(conns, ("file", snap))
                    if any(d != want for d in digests):
                        raise SystemExit("bench_weights: a receiver's file load differs from the core's state")
                    times["file"].append(wall)
        finally:
            for c in conns:
                c.send(("stop",))
            for p in procs:
                p.join(timeout=10)
    total = gib * args.receivers
    for way, label in (("raw", "raw Transfer Engine (baseline)"), ("ours", "ours (transfer/weights.py)"),
                       ("verified", "ours + verify (SHA-256 per bucket)"), ("file", "file snapshot (load_file)")):
        s = Spread(times[way])
        print(f"{label:36s} {s.show('.3f')} s to the last receiver, {total / s.median:.2f} GiB/s aggregate, "
              f"{gib / s.median:.2f} GiB/s per receiver")
    pub_s, write_s = Spread(publish_s[1:]), Spread(save_s)
    print(f"core's part: publish (copy into the slot + digests) {pub_s.show('.3f')} s; "
          f"snapshot write {write_s.show('.3f')} s")
    ours_e2e = pub_s.median + Spread(times["ours"]).median
    file_e2e = write_s.median + Spread(times["file"]).median
    print(f"end to end (core's part + receivers'): ours {ours_e2e:.3f} s, file snapshot {file_e2e:.3f} s "
          f"(file/ours {file_e2e / ours_e2e:.2f}); verify costs "
          f"{statistics_ratio(times['verified'], times['ours']):.2f}x ours' time")
    ratio = statistics_ratio(times["raw"], times["ours"])
    ok = ratio >= TARGET
    print(f"ours/raw throughput: {ratio:.3f} (target >= {TARGET}) {'OK' if ok else 'MISSED'}")
    return 0 if ok else 1


def statistics_ratio(base: list[float], ours: list[float]) -> float:
    """base's median time over ours': ours' throughput relative to base's."""
    return Spread(base).median / Spread(ours).median


if __name__ == "__main__":
    sys.exit(main())
