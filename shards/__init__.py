"""shardcache's on-disk contract and streaming reader: manifests, shard formats, decoding, the IterableDataset."""

__version__ = "0.1.0"
