"""Scalars into TensorBoard event files, with the `tensorboard` package's own writer and protos.

Not torch's SummaryWriter: the daemon process must never import torch. Values are written as `simple_value`
(float32), as torch's add_scalar does; each point is one Event (its step = x, its wall_time = when the step or
evaluation ended in the ledger, so a live log and an export of the same run are the same events).
"""

from __future__ import annotations

from pathlib import Path

from gyre_slurm.tracking.series import Point


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, logdir: Path) -> None:
        # imported here: a run without this backend never loads tensorboard
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self.logdir = Path(logdir)
        # the writer creates the folder and its event file now: an unwritable tb/ fails here, at start
        self._writer = EventFileWriter(str(self.logdir), flush_secs=10)

    def write(self, point: Point) -> None:
        values = [self._summary.Value(tag=t, simple_value=v) for t, v in point.values.items()]
        self._writer.add_event(self._event(wall_time=point.wall_time, step=point.x,
                                           summary=self._summary(value=values)))
        self._writer.flush()  # on disk before the next step: a crash loses nothing TensorBoard could show

    def close(self) -> None:
        self._writer.close()
