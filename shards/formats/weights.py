"""Reading a local weights file into a state dict, without ever unpickling an object.

Used wherever a user names a weights file (a backbone for ``precompute-features``, a model to fine-tune in
``train-from-shards``). ``.safetensors`` files go through ``safetensors``; ``.pt``/``.pth`` (and anything else)
through ``torch.load(weights_only=True)``. Accepted shapes: a plain ``{name: tensor}`` dict, or one level of the
usual wrappers (``{"state_dict": ...}`` as in a run's ``model.pt``, ``{"model": ...}`` as in ``last.pt``).
DistributedDataParallel's ``module.`` prefix is removed when every name carries it (only then, so a model with a
submodule really called ``module`` keeps its names).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch

from shards.door.bounded_read import load_weights_only, open_regular_file, parser_guard
from shards.errors import InputError, MissingInputError

WRAPPER_KEYS = ("state_dict", "model")


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The ``{name: tensor}`` state dict in the local file ``path``; ``InputError`` naming the file otherwise."""
    path = Path(path)
    if not path.is_file():
        raise MissingInputError("weights file not found", path=str(path))
    return unwrap_state_dict(_load(path), str(path))


def unwrap_state_dict(data: Any, where: str) -> dict[str, torch.Tensor]:
    """A loaded object as a plain state dict: one wrapper level removed, DDP's ``module.`` prefix dropped."""
    if isinstance(data, Mapping):
        for nested in WRAPPER_KEYS:
            if isinstance(data.get(nested), Mapping):
                data = data[nested]
                break
    if not isinstance(data, Mapping) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise InputError("holds no state dict of tensors (expected a dict, or one under 'state_dict' or 'model')",
                         path=where)
    if data and all(str(k).startswith("module.") for k in data):  # saved from DistributedDataParallel
        return {k[len("module."):]: v for k, v in data.items()}
    return dict(data)


def _load(path: Path) -> Any:
    where = str(path)
    if path.suffix == ".safetensors":
        try:
            from safetensors import SafetensorError
            from safetensors.torch import load_file
        except ImportError:
            raise InputError("reading .safetensors needs the 'safetensors' package (pip install safetensors), "
                             "or save the weights with torch.save as .pt", path=where) from None
        open_regular_file(path).close()
        with parser_guard(where, "not a readable weights file", error=InputError, catch=(SafetensorError,)):
            return load_file(where)
    return load_weights_only(path, where, "not a readable weights file", error=InputError)
