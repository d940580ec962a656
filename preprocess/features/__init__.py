"""``precompute-features``: a frozen backbone over image shards, penultimate features out, cached per shard."""
