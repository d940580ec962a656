"""Which ``--device`` names the commands and configs accept: one rule, checked without importing torch.

``shards.jobs.devices.resolve_device`` turns a name into a ``torch.device`` when the job starts; this module only
says whether a name is one, so ``--help``, option parsing and config validation stay light.
"""

from __future__ import annotations

import re

from shards.errors import InputError

_DEVICE_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_name(value: object, field: str = "device") -> str:
    """``value`` if it is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``, else an ``InputError`` naming ``field``."""
    if not isinstance(value, str) or not _DEVICE_NAME.fullmatch(value):
        raise InputError(f"{field}={value!r} is not a device: use auto, cpu, cuda or cuda:N")
    return value
