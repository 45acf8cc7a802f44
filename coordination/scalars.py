"""A run's scalars for TensorBoard, written with TensorBoard's own event-file writer and protos: the
writer `torch.utils.tensorboard.SummaryWriter` wraps, the same files (`events.out.tfevents.*`), read
back by `cellfeed report` and TensorBoard itself. Without torch: the campaign's monitor (a local
campaign's orchestrator, a Modal `train` call) imports nothing else of torch, and importing
`torch.utils.tensorboard` there cost ~2.5 CPU-s per campaign (torch, then TensorBoard); this, ~0.5 s."""

from __future__ import annotations

import os
import time

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter


class ScalarWriter:
    """`add_scalar(tag, value, step)`, `flush()`, `close()`: a SummaryWriter's scalar half."""

    def __init__(self, logdir: str | os.PathLike, filename_suffix: str = ""):
        # (SummaryWriter's own defaults: 10 events queued, flushed at least every 120 s and at close)
        self._file = EventFileWriter(str(logdir), max_queue_size=10, flush_secs=120, filename_suffix=filename_suffix)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])  # (SummaryWriter's old style)
        self._file.add_event(Event(wall_time=time.time(), step=int(step), summary=summary))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()
