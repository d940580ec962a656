"""The order: which rows each worker of each rank yields, in which order, as pure functions (the shard plan, class weighting, the shuffle buffer)."""
