"""Shard formats on disk: the raw sample, tar and HDF5 image shards, feature files, the storage registry, locations."""
