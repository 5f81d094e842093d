"""A receiver process for tests/test_weight_transport.py: reads a WeightsHandle (JSON) on stdin, says "pulling",
pulls it over its own Transfer Engine and prints {name: sha256} of what it received (or the error), one line."""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from gyre_slurm.protocol import WeightsHandle
from gyre_slurm.transfer.engine import TransferAgent, TransferError
from gyre_slurm.transfer.weights import WeightPuller


def tensor_digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: hashlib.sha256(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())).hexdigest()
            for n, t in tensors.items()}


def main() -> None:
    handle = WeightsHandle.model_validate_json(sys.stdin.readline())
    puller = WeightPuller(TransferAgent(), "test")
    print("pulling", flush=True)
    try:
        tensors, report = puller.pull(handle)
    except TransferError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return
    print(json.dumps({"digests": tensor_digests(tensors), "bytes": report.nbytes}), flush=True)


if __name__ == "__main__":
    main()
