"""Adopting WebDataset tars in place: ``shards index`` writes a shardcache index of tars it never writes to."""
