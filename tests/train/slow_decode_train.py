"""``train-from-shards`` with one rank's image decoding slowed: the torchrun entry of ``test_stragglers``.

A test-only hook, so the library reads no environment for it: on the rank named by ``SLOW_DECODE_RANK`` every
decoded sample first sleeps ``SLOW_DECODE_S`` seconds (in the process that decodes: the loop itself with
``--workers 0``, forked DataLoader workers inherit the hook). What is measured is untouched: the rank really waits.
"""

from __future__ import annotations

import os
import time

from shards.stream.image_dataset import ImageShardDataset
from train.cli import train_command


def slow_down_decoding(delay_s: float) -> None:
    decode_row = ImageShardDataset.decode_row

    def slow_decode_row(self, sample, seed, row):
        time.sleep(delay_s)
        return decode_row(self, sample, seed, row)

    ImageShardDataset.decode_row = slow_decode_row


if __name__ == "__main__":
    if os.environ.get("RANK", "0") == os.environ["SLOW_DECODE_RANK"]:
        slow_down_decoding(float(os.environ["SLOW_DECODE_S"]))
    train_command()
