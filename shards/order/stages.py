"""What flows between reading and decoding: ``(where, sample, row)`` items, and the marker of an unreadable sample.

``where`` names the shard for error messages, ``sample`` has ``key`` and ``label``, ``row`` is the sample's global
index in its split (the key of a decoded-image cache). Nothing here decides order: the shuffle buffer and class
weighting never look at the bytes, so they are index arithmetic in ``shards.order`` (``order.buffer_positions``,
``weights.weighted_stream``), which a resumed run replays without reading.
"""

from __future__ import annotations

from typing import NamedTuple


class Broken(NamedTuple):
    """Placeholder for a sample that could not be read, kept in the stream so counts and order stay fixed."""

    key: str | None
    label: int
    reason: str
