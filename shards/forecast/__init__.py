"""The forecast: what an epoch will ask of storage, computed from the plan before any shard is read (docs/caching.md,
"Forecast")."""
