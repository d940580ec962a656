"""A loader's position as ``torch.distributed.checkpoint`` (DCP) stores it: one opaque entry, the same on every rank.

DCP flattens a ``Stateful``'s nested dicts into one key per leaf, and on load asks the checkpoint for exactly the keys
of the state the fresh loader returns now. A saved ``LoaderState`` changes shape with the run (``prior`` is a record
or None, ``excluded`` present or absent), so the plain record would fail to load ("Missing key") or, worse, have parts
dropped without a word. So DCP gets the record as one JSON string under one key.

DCP also keeps one copy of a key that several ranks write. That is exactly right here: every rank consumes the same
number of batches, so the position is the same on every rank (``shards.stream.resume``), and one record continues
every rank of any world size: the same layout bitwise, another elastically (``shards.stream.elastic``). A key per rank
would make a resume on more ranks fail, since a new rank would ask for a key no rank wrote. What one copy loses is the
samples other ranks quarantined (``shards.stream.watchdog``): the kept copy carries its own rank's list only.
"""

from __future__ import annotations

import json
from typing import Any

from shards.errors import InputError

KEY = "loader_state"


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
        try:
            record = json.loads(text)
        except ValueError as error:
            raise InputError(f"the checkpoint's {KEY!r} is not valid JSON: {error}") from None
        self.loader.load_state_dict(record)
