"""Whether a dataset's callable image transform draws from a process-global random generator: torch's default
generator, Python's ``random`` or NumPy's global state. Found by running it on the dataset's first samples and
comparing those generators' states around each step, not by a list of known classes, so a user's own transform is
judged by what it does.

Why: ``Threads(n)`` runs transforms in the training process, beside the training step. A transform that draws
from a global generator there would race the step's own random numbers and could not be seeded per sample (a worker
process seeds its generator per sample, ``shards.image.decode.ImageDecoder``; threads share the trainer's). One
that draws nothing, such as the usual eval pipeline ``Compose([Resize, CenterCrop, ToTensor, Normalize])``, runs in
threads as it is; the decoder is told so (``ImageDecoder.draws_nothing``) and then leaves the generator alone.
A transform that draws only on some inputs and not on the first samples passes the probe: the probe sees what
the transform does, not what it might do.
"""

from __future__ import annotations

import random
import weakref
from typing import Any, Callable, Iterator

import numpy as np
import torch

from shards.errors import CorruptDataError
from shards.order.plan import ShardSlice

PROBE_SAMPLES = 3  # decodable samples of the first shard the transform is run on

_FIX = ("give the transform as a preset name or TransformSpec (they draw from each sample's seed), or run it in "
        "WorkerProcesses(n)")
_REFUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder -> why, so a refusal is probed once


def global_draws(dataset: Any) -> str | None:
    """Why ``dataset``'s transform cannot run in loader threads (it drew from a global generator on the first
    samples, named by step), or None: none to check (presets, ``TransformSpec``, the fast pipeline, feature rows),
    or it drew nothing, which the decoder is then told."""
    decoder = getattr(dataset, "decoder", None)
    if not getattr(decoder, "draws_from_global_generator", False):
        return None
    if decoder in _REFUSED:
        return _REFUSED[decoder]
    images = list(_first_images(dataset, decoder))
    if not images and dataset.split_info.samples:
        why = ("the transform could not be checked for draws from global random generators (the first samples "
               f"would not decode), which loader threads share with the training step: {_FIX}")
    else:
        why = _first_draw(decoder.transform, images)
    if why is None:
        decoder.draws_nothing = True
    else:
        _REFUSED[decoder] = why
    return why


def _first_images(dataset: Any, decoder: Any) -> Iterator[Any]:
    """Up to ``PROBE_SAMPLES`` decoded images from the start of the first non-empty shard, as a worker decodes
    them (draft size included), undecodable ones passed over."""
    shard = next((i for i, info in enumerate(dataset.split_info.shards) if info.samples), None)
    if shard is None:
        return
    rows = min(4 * PROBE_SAMPLES, dataset.split_info.shards[shard].samples)
    found = 0
    for sample in dataset.read_resync(ShardSlice(shard, 0, rows)):
        if isinstance(sample, CorruptDataError):
            continue
        try:
            image = decoder.decode(sample.data, sample.ext)
        except CorruptDataError:
            continue
        yield image
        found += 1
        if found == PROBE_SAMPLES:
            return


def _first_draw(transform: Callable, images: list[Any]) -> str | None:
    """Run ``transform`` step by step on each image, every global generator restored afterwards; what the first
    step that moved one drew from, as the refusal says it, or None."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            for image in images:
                for step in _steps(transform):
                    before = _states()
                    image = step(image)
                    moved = [name for name, was, now in zip(_NAMES, before, _states()) if not _same(was, now)]
                    if moved:
                        return (f"the transform's {_name(step)} draws from {' and '.join(moved)}, which loader "
                                f"threads share with the training step: {_FIX}")
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
    return None


_NAMES = ("torch's global random generator", "Python's global random generator (random)",
          "NumPy's global random generator (np.random)")


def _states() -> tuple[Any, Any, Any]:
    return torch.default_generator.get_state(), random.getstate(), np.random.get_state()


def _same(was: Any, now: Any) -> bool:
    if isinstance(was, torch.Tensor):
        return torch.equal(was, now)
    if isinstance(was, tuple) and len(was) == 5 and isinstance(was[1], np.ndarray):  # NumPy's legacy state
        return was[0] == now[0] and np.array_equal(was[1], now[1]) and was[2:] == now[2:]
    return was == now


def _steps(transform: Callable) -> list[Callable]:
    """A torchvision ``Compose`` (v1 or v2) as its steps, nested ones flattened, so a refusal names the step that
    draws; anything else is one step (``RandomChoice`` and the like draw to pick among theirs)."""
    inner = getattr(transform, "transforms", None)
    if type(transform).__name__ == "Compose" and isinstance(inner, (list, tuple)):
        return [step for part in inner for step in _steps(part)]
    return [transform]


def _name(step: Callable) -> str:
    text = repr(step)  # torchvision's reprs say the settings; a plain object's says only its address
    return text if len(text) <= 80 and "\n" not in text and not text.startswith("<") else type(step).__name__
