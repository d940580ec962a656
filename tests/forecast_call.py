"""The forecast of a dataset folder as ``shards plan`` makes it: the folder opened as rank 0 of the run's layout,
forecast in the run mode ``workers`` names (``shards.forecast.plan.forecast`` takes the dataset and the mode)."""

from __future__ import annotations

from typing import Any

import shards
from shards.forecast.plan import Forecast, forecast
from shards.loader.loader import workers_mode


def forecast_of(path: Any, *, epochs: int, batch_size: int, world_size: int = 1, nodes: int = 1, workers: int = 0,
                seed: int = 0, shuffle: bool = True, persistent: bool = True, storage_options: Any = None,
                **options: Any) -> Forecast:
    dataset = shards.open_dataset(str(path), seed=seed, sampling=shards.Sampling(shuffle=shuffle),
                                  distributed=shards.Distributed(rank=0, world_size=world_size, nodes=nodes),
                                  remote=shards.Remote(storage_options=storage_options))
    return forecast(dataset, workers_mode(workers, persistent=persistent), epochs, batch_size=batch_size, **options)
