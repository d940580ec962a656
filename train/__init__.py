"""shardcache train package."""
