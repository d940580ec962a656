"""shardcache preprocess package."""
