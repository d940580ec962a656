"""A loader's position as ``torch.distributed.checkpoint`` (DCP) stores it: one opaque entry, the same on every rank.

DCP flattens a ``Stateful``'s nested dicts into one key per leaf, and on load asks the checkpoint for exactly the keys
of the state the fresh loader returns now. A saved ``LoaderState`` changes shape with the run (``prior`` is a record
or None, ``excluded`` present or absent), so the plain record would fail to load ("Missing key") or, worse, have parts
dropped without a word. So DCP gets the record as one JSON string under one key.

DCP also keeps one copy of a key that several ranks write. That is exactly right here: every rank consumes the same
number of batches, so the position is the same on every rank (``shards.position.resume``), and one record continues
every rank of any world size: the same layout bitwise, another elastically (``shards.position.elastic``). A key per rank
would make a resume on more ranks fail, since a new rank would ask for a key no rank wrote. What one copy loses is the
samples other ranks quarantined (``shards.loader.watchdog``): the kept copy carries its own rank's list only.

A checkpoint is untrusted input: the string is parsed through the one door (``bounded_read.parse_json``: a length
cap, a nesting cap) and the record checked field by field by ``load_state_dict`` (``LoaderState.from_dict``).
"""

from __future__ import annotations

import json
from typing import Any

from shards.door.bounded_read import JSONError, parse_json
from shards.errors import InputError
from shards.units import human_bytes

KEY = "loader_state"
# The longest record a loader saves: ~340 bytes, class weights, 10,000 quarantined samples and up to 10 million
# excluded rows (``elastic.MAX_EXCLUDED``) at ~9 characters each.
MAX_STATE_CHARS = 128 << 20


class DcpLoaderState:
    """``loader.dcp_state()``: the ``Stateful`` to hand DCP, ``dcp.save({"data": loader.dcp_state(), ...})`` and
    ``dcp.load`` alike, on every rank."""

    def __init__(self, loader: Any):
        self.loader = loader

    def state_dict(self) -> dict[str, str]:
        return {KEY: json.dumps(self.loader.state_dict(), sort_keys=True)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        text = state.get(KEY) if isinstance(state, dict) else None
        if not isinstance(text, str):
            raise InputError(f"the checkpoint entry is not a shardcache loader state saved with loader.dcp_state() "
                             f"(expected a dict with a {KEY!r} string)")
        if len(text) > MAX_STATE_CHARS:
            raise InputError(f"the checkpoint's {KEY!r} holds {human_bytes(len(text))}, more than a loader state "
                             f"({human_bytes(MAX_STATE_CHARS)} at most)")
        try:
            record = parse_json(text)
        except JSONError as error:
            raise InputError(f"the checkpoint's {KEY!r} is {error}") from None
        self.loader.load_state_dict(record)
