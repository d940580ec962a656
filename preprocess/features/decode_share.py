"""``precompute-features --decode auto``: how much of the decoding the model's device takes, from measured costs.

With ``--decode device --device-share S`` a person picks S, and the right S moves with the backbone, the batch size,
the images and what else the node runs (DALI's split is hand set too, and DALI#6366 reports its p99 latency up 40%
with it). Here the split follows the run's own measurements:

- the device's side of a batch is its decoding (``device_s``: seconds per image it decoded) on top of the work the
  device does for every batch anyway (``forward_s``: the forward and the copy back), in series on one device;
- the CPU side is the workers' decoding of the other images (``cpu_s``: seconds per image of the worker pool
  together, one worker's seconds per image over the number of workers), beside the device;
- a batch takes the longer of the two, so the share that balances them is the one with the shortest step; the
  controller takes, for each side, a high quantile (``tail``) of the batches it measured rather than their mean,
  so the share balances the slow batches of each side, which set p99 step time, not the typical ones.

Decisions are taken every ``every`` batches from the batches measured since the last one (old measurements age
out: a run whose images or neighbours change gets a new share), on a grid of ``grid`` shares (a small set of
splits, each a fixed function of the sample keys, ``loader.decodes_on_device``), and only when the new share's
predicted step is shorter by more than ``hysteresis`` of the current one's (no flapping between neighbours that
cost the same). Each side keeps at least ``1 / grid`` of the images (``probe``), so both stay measured.
Everything here is a pure function of the measurements given: the same measurements give the same shares.

``SplitMeter`` is the consumer's side: it times each chunk's decoding and forward on the device, takes the workers'
CPU seconds from the batch, and writes the controller's share where the workers read it for the next samples. On
a machine without an accelerator there is no device side: ``resolve_auto`` makes ``auto`` the CPU workers' fast
path, and says so in one log line, and the features are those of ``--decode fast``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import multiprocessing
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from shards.errors import InputError

if TYPE_CHECKING:
    import torch

    from preprocess.features.config import FeatureConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchCosts:
    """What one batch cost each side, in seconds; ``None`` where a side decoded nothing in that batch."""

    device_s: float | None  # per image the device decoded (decode + crop on the device)
    cpu_s: float | None  # per image the workers decoded, for the pool together (one worker's time / workers)
    forward_s: float  # the device's work for the whole batch besides decoding (forward, copy back)
    images: int

    def __post_init__(self) -> None:
        for name in ("device_s", "cpu_s", "forward_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise InputError(f"BatchCosts.{name} must be a finite number of seconds >= 0, got {value!r}")
        if type(self.images) is not int or self.images < 1:
            raise InputError(f"BatchCosts.images must be an integer >= 1, got {self.images!r}")


@dataclass(frozen=True)
class ShareControl:
    """The controller's settings (module docstring)."""

    every: int = 16
    tail: float = 0.99
    hysteresis: float = 0.05
    grid: int = 32
    start: float = 0.5  # the first batches' share: both sides measured from the start

    def __post_init__(self) -> None:
        if type(self.every) is not int or self.every < 1:
            raise InputError(f"ShareControl.every must be an integer >= 1 (batches), got {self.every!r}")
        if not 0.5 <= self.tail <= 1.0:
            raise InputError(f"ShareControl.tail must be a quantile in [0.5, 1], got {self.tail!r}")
        if not 0.0 <= self.hysteresis < 1.0:
            raise InputError(f"ShareControl.hysteresis must be in [0, 1), got {self.hysteresis!r}")
        if type(self.grid) is not int or not 2 <= self.grid <= 1024:
            raise InputError(f"ShareControl.grid must be an integer in 2..1024, got {self.grid!r}")
        if not self.probe <= self.start <= 1.0 - self.probe:
            raise InputError(f"ShareControl.start must be in [{self.probe:g}, {1 - self.probe:g}], got {self.start!r}")

    @property
    def probe(self) -> float:
        """The least share either side keeps, so that both stay measured."""
        return 1.0 / self.grid

    def shares(self) -> list[float]:
        """The shares a decision picks from, ascending."""
        return [k / self.grid for k in range(1, self.grid)]


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (no interpolation: a value that was measured)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def predicted_step(share: float, device_s: float, cpu_s: float, forward_s: float, images: int) -> float:
    """Seconds per batch when the device decodes ``share`` of ``images``: the longer of its decoding plus its
    forward, and the workers' decoding of the rest."""
    return max(share * images * device_s + forward_s, (1.0 - share) * images * cpu_s)


def best_share(shares: Sequence[float], device_s: float, cpu_s: float, forward_s: float, images: int) -> float:
    """The share of ``shares`` with the shortest predicted step; on a tie the larger (the CPU keeps more room for
    the rest of the node)."""
    return min(reversed(shares), key=lambda s: predicted_step(s, device_s, cpu_s, forward_s, images))


@dataclass
class ShareController:
    """Measured batches in, the device's share out (``observe``); ``history`` holds each change of share with the
    batch it took effect after."""

    control: ShareControl = field(default_factory=ShareControl)
    share: float = field(init=False)
    batches: int = field(init=False, default=0)
    history: list[tuple[int, float]] = field(init=False, default_factory=list)
    _window: list[BatchCosts] = field(init=False, default_factory=list)
    _last: dict[str, float] = field(init=False, default_factory=dict)  # each side's cost at the last decision

    def __post_init__(self) -> None:
        self.share = self.control.start
        self.history.append((0, self.share))

    def observe(self, costs: BatchCosts) -> float:
        """Take one batch's costs; every ``every`` batches decide again. Returns the share for the next batches."""
        self.batches += 1
        self._window.append(costs)
        if len(self._window) >= self.control.every:
            self._decide(self._window)
            self._window = []
        return self.share

    def _decide(self, window: list[BatchCosts]) -> None:
        tail = self.control.tail
        for side in ("device_s", "cpu_s"):
            measured = [getattr(c, side) for c in window if getattr(c, side) is not None]
            if measured:  # a side with no images in the window keeps its last cost
                self._last[side] = quantile(measured, tail)
        if len(self._last) < 2:
            return
        forward = quantile([c.forward_s for c in window], tail)
        images = max(c.images for c in window)
        costs = (self._last["device_s"], self._last["cpu_s"], forward, images)
        proposed = best_share(self.control.shares(), *costs)
        now, then = predicted_step(self.share, *costs), predicted_step(proposed, *costs)
        if proposed != self.share and then < now * (1.0 - self.control.hysteresis):
            self.share = proposed
            self.history.append((self.batches, proposed))

    def record(self) -> dict[str, Any]:
        """What the run summary keeps: the shares taken and after which batch, and the last measured costs."""
        return {"share": self.share, "batches": self.batches, "history": [list(h) for h in self.history],
                "costs_s": {side: round(cost, 9) for side, cost in sorted(self._last.items())}}


def resolve_auto(cfg: "FeatureConfig", device: "torch.device") -> "FeatureConfig":
    """``cfg`` with ``decode="auto"`` made concrete for ``device``: without an accelerator the CPU workers decode
    everything, the fast path (``--decode fast``'s features, record and config hash); any other decode as given."""
    if cfg.decode != "auto":
        return cfg
    if device.type == "cpu":
        log.info("--decode auto: no accelerator (device %s), so the CPU workers decode every image (--decode fast)",
                 device)
        return dataclasses.replace(cfg, decode="fast")
    if cfg.augment:
        raise InputError("--decode auto splits the eval crop's decoding between the device and the workers; with "
                         "--augment use --decode device or --decode fast")
    return cfg


DEFAULT_CONTROL = ShareControl()


def live_split(decode: str, workers: int, device: "torch.device") -> "SplitMeter | None":
    """For ``decode="auto"`` (left so by ``resolve_auto``: an accelerator is there) the meter that measures and sets
    the split, its shared share starting at ``DEFAULT_CONTROL.start``; None for any other decode."""
    if decode != "auto":
        return None
    controller = ShareController(DEFAULT_CONTROL)
    return SplitMeter(controller, multiprocessing.RawValue("d", controller.share), workers, device)


@dataclass
class _Chunk:
    spans: dict[str, tuple[Any, Any]]  # "decode", "forward" -> (start, end): CUDA events, or host clock readings
    images: int
    device_images: int
    cpu_s: list[float]  # the worker CPU seconds of each image the workers decoded


class SplitMeter:
    """The consumer's side of ``--decode auto``: per chunk, the device's decoding and forward timed (CUDA events
    on the stream each runs on, read once they completed, so the host never waits for them; the host clock off
    CUDA), the workers' CPU seconds per image taken from the batch, the costs given to the controller, and the share
    it returns written where the workers read it (``live``, a ``multiprocessing.RawValue``)."""

    def __init__(self, controller: ShareController, live: Any, workers: int, device: "torch.device"):
        self.controller, self.live, self.workers = controller, live, max(1, workers)
        self.cuda = device.type == "cuda"
        self._spans: dict[str, tuple[Any, Any]] = {}
        self._pending: list[_Chunk] = []

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: the side stream while preparing, the forward's stream after
        return event

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        start = self._mark()
        yield
        self._spans[name] = (start, self._mark())

    def chunk_done(self, pieces: Sequence[dict[str, Any]]) -> None:
        """The chunk whose spans were just timed: its images, those the device decoded, the workers' seconds."""
        datas = [d for p in pieces for d in p.get("data", ())]
        cpu_s = [c for p in pieces for c in p.get("cpu_s", ()) if c is not None]
        self._pending.append(_Chunk(self._spans, len(datas), sum(d is not None for d in datas), cpu_s))
        self._spans = {}
        self._settle()

    def _seconds(self, span: tuple[Any, Any]) -> float:
        start, end = span
        return start.elapsed_time(end) / 1000.0 if self.cuda else end - start

    def _settle(self) -> None:
        while self._pending and (not self.cuda or all(end.query() for _, end in self._pending[0].spans.values())):
            chunk = self._pending.pop(0)
            if not chunk.images or "forward" not in chunk.spans:
                continue  # a shard without samples: nothing measured
            decode = self._seconds(chunk.spans["decode"]) if "decode" in chunk.spans else 0.0
            costs = BatchCosts(decode / chunk.device_images if chunk.device_images else None,
                               sum(chunk.cpu_s) / len(chunk.cpu_s) / self.workers if chunk.cpu_s else None,
                               self._seconds(chunk.spans["forward"]), chunk.images)
            self.live.value = self.controller.observe(costs)
