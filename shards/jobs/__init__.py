"""What every batch job shares: the overwrite rules, process pools per shard, logs and progress bars, the device choice."""
