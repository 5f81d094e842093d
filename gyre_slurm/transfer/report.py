"""What one receiver says about one transfer: the ledger's weight_transfers row and a benchmark's figure."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TransferReport:
    transport: str  # mooncake, file, nccl, remote_instance
    version: int
    nbytes: int
    seconds: float  # from the first byte asked for to the last one checked and in place
    receiver: str = ""  # e.g. "engine:1", "satellite:2"
    ok: bool = True
    error: str | None = None
    source: str = ""  # where the version also lies (its snapshot folder), as its publisher said; "" unknown
    sender_rank: int | None = None  # the core's rank whose part of a sliced version this was

    @property
    def gib_s(self) -> float:
        return self.nbytes / self.seconds / 2**30 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "gib_s": self.gib_s}
