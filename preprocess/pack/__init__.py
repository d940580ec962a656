"""``pack-shards``: source files in, validated, shuffled, sequential shards and ``dataset.json`` out."""
