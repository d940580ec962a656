"""Caches for reading: the node-local cache of whole shards (its folder's bookkeeping, and which locations read
through it), the decoded-image memory cache, the memory budget it sizes itself by, and the shared arrays it keeps."""
