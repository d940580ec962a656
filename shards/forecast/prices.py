"""A price table for the forecast's bill: the user's file, read through the door (docs/caching.md, "Prices").

Prices change and differ by region and contract, so none is built in: the user gives a small JSON file, and the one
shipped (``docs/prices-s3-example.json``) is an example of dated public list prices, never assumed current.

    {"format": "shardcache.prices", "version": 1, "date": "2025-06-01", "currency": "USD",
     "note": "...", "tables": {"s3-standard": {"per_1000_requests": 0.0004, "per_gb": 0.0, "note": "..."}}}

Per table: ``per_1000_requests`` (GET requests), ``per_gb`` (every byte served: transfer out, or retrieval), and
optionally ``per_gb_over`` with ``free_bytes_per_request`` (a charge only on the bytes of each request beyond an
allowance, as S3 Express One Zone bills retrieval beyond 512 KB). A GB is 2**30 bytes, as AWS bills it. The file is
untrusted: at most ``MAX_PRICES_BYTES``, at most ``MAX_TABLES`` tables, every field checked, one line naming the
file and field on any problem.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from shards.door.bounded_read import read_json_file
from shards.door.shape import as_int, as_number, as_object, as_str, field
from shards.errors import InputError
from shards.forecast.requests import Traffic

PRICES_FORMAT, PRICES_VERSION = "shardcache.prices", 1
MAX_PRICES_BYTES = 64 << 10
MAX_TABLES = 32
GB = 1 << 30
_TABLE_FIELDS = {"per_1000_requests", "per_gb", "per_gb_over", "free_bytes_per_request", "note"}
_TOP_FIELDS = {"format", "version", "date", "currency", "note", "tables"}


@dataclass(frozen=True)
class PriceTable:
    """One storage class's prices (see the module docstring)."""

    name: str
    per_1000_requests: float
    per_gb: float
    per_gb_over: float = 0.0
    free_bytes_per_request: int = 0

    def cost(self, traffic: Traffic) -> float:
        """What ``traffic`` costs under this table."""
        return (traffic.requests / 1000 * self.per_1000_requests + traffic.bytes / GB * self.per_gb
                + traffic.over(self.free_bytes_per_request) / GB * self.per_gb_over)


@dataclass(frozen=True)
class Prices:
    """The tables of one file, with the date their prices were read and the currency."""

    date: str
    currency: str
    tables: tuple[PriceTable, ...]
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"date": self.date, "currency": self.currency, "note": self.note,
                "tables": [table.name for table in self.tables]}


def load_prices(path: str | os.PathLike) -> Prices:
    """The price tables in the JSON file ``path`` (``InputError`` naming the file and field when it is not one)."""
    where = os.fspath(path)
    return prices_from(read_json_file(where, limit=MAX_PRICES_BYTES), where)


def prices_from(value: Any, where: str) -> Prices:
    """A parsed price file, checked field by field."""
    data = as_object(value, "the price file", where=where, error=InputError)
    if data.get("format") != PRICES_FORMAT or data.get("version") != PRICES_VERSION:
        raise InputError(f"not a {PRICES_FORMAT} file of version {PRICES_VERSION} (\"format\" and \"version\")",
                         path=where)
    unknown = sorted(set(data) - _TOP_FIELDS)
    if unknown:
        raise InputError(f"unknown field {unknown[0]!r:.40}; known: {', '.join(sorted(_TOP_FIELDS))}", path=where)
    date = as_str(field(data, "date", "", where=where, error=InputError), "date", max_len=40, where=where,
                  error=InputError)
    currency = as_str(field(data, "currency", "", default="USD", where=where, error=InputError), "currency",
                      max_len=8, where=where, error=InputError)
    note = as_str(field(data, "note", "", default="", where=where, error=InputError), "note", where=where,
                  error=InputError)
    tables = as_object(field(data, "tables", "", where=where, error=InputError), "tables", where=where,
                       error=InputError)
    if not 1 <= len(tables) <= MAX_TABLES:
        raise InputError(f"tables holds {len(tables)} tables: expected 1 to {MAX_TABLES}", path=where)
    return Prices(date, currency, tuple(_table(name, entry, where) for name, entry in tables.items()), note)


def _table(name: str, value: Any, where: str) -> PriceTable:
    what = f"tables.{name[:40]}"
    as_str(name, "a table's name", max_len=64, where=where, error=InputError)
    table = as_object(value, what, where=where, error=InputError)
    unknown = sorted(set(table) - _TABLE_FIELDS)
    if unknown:
        raise InputError(f"{what} has unknown field {unknown[0]!r:.40}; known: {', '.join(sorted(_TABLE_FIELDS))}",
                         path=where)

    def price(key: str, required: bool = True) -> float:
        raw = field(table, key, what, where=where, error=InputError, **({} if required else {"default": 0.0}))
        return as_number(raw, f"{what}.{key}", lo=0.0, hi=1e6, where=where, error=InputError)

    if "note" in table:
        as_str(table["note"], f"{what}.note", where=where, error=InputError)
    free = as_int(field(table, "free_bytes_per_request", what, default=0, where=where, error=InputError),
                  f"{what}.free_bytes_per_request", hi=1 << 40, where=where, error=InputError)
    return PriceTable(name, price("per_1000_requests"), price("per_gb"), price("per_gb_over", False), free)
