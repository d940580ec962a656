"""A dataset iterated on its own (``for sample in dataset``, or a plain DataLoader over it) is its own loader.

``make_loader``'s loaders keep their position in a cursor (``shards.position.cursor``) and hand each stream its
start (``StreamJob``). A dataset iterated without one still resumes (``dataset.state_dict()``) and counts its stage
seconds, so it keeps an ``OwnLoader``: a cursor of one worker and batches of one sample, and a stage-seconds block
made before any DataLoader copies the dataset into its workers (so the copies add to it). Inside a plain
DataLoader's worker it streams that worker's share of the epoch from the start: a plain DataLoader has no position
to hand it.
"""

from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import get_worker_info

from shards.position.cursor import Cursor
from shards.position.resume import STREAM
from shards.procs.stage_times import SharedStageTimes
from shards.stream.worker_stream import StreamJob


class OwnLoader:
    """The position and stage seconds of ``dataset`` iterated on its own."""

    def __init__(self, dataset: Any):
        self.cursor = Cursor(dataset, STREAM, batch_size=1, num_workers=0, drop_last=False, split_batch=1)
        self.stage_times = SharedStageTimes()

    def samples(self) -> Iterator[Any]:
        """One iteration of the dataset's current epoch, from a loaded state's position if one is pending."""
        dataset = self.cursor.dataset
        times = self.stage_times if dataset.time_stages else None
        info = get_worker_info()
        if info is not None:  # inside a plain DataLoader's worker: its share of the epoch, from the start
            yield from dataset.worker_stream(StreamJob(dataset.epoch, info.id, info.num_workers, stage_times=times))
            return
        cursor = self.cursor
        continued = cursor.begin()
        resume = cursor.resume(continued)
        job = StreamJob(dataset.epoch, skip=resume.skips[0] if resume is not None else 0,
                        left=continued.left if continued is not None else None, stage_times=times,
                        quarantine=frozenset(cursor.quarantine))
        for output in dataset.worker_stream(job):
            cursor.handed += 1
            yield output
