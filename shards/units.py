"""Byte sizes as people write them (``256M``, ``50GiB``) and as logs show them (``2.0 GiB``): one parser for every
command's size options and every library keyword that takes a size."""

from __future__ import annotations

import re

from shards.errors import InputError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*\Z", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(value: int | str, name: str = "size") -> int:
    """``268435456``, ``256M``, ``256MiB``, ``1.5G`` (binary units) -> bytes."""
    if isinstance(value, bool):
        raise InputError(f"{name}={value!r} is not a size like 268435456, 256M or 1G")
    if isinstance(value, int):
        if value < 0:
            raise InputError(f"{name}={value} must not be negative")
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise InputError(f"{name}={value!r} is not a size like 268435456, 256M or 1G")
    unit = (match.group(2) or "").upper()[:1]
    return int(float(match.group(1)) * _UNITS[unit])


def human_bytes(size: float) -> str:
    """``2147483648`` -> ``2.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
