"""The location layer: local files, ``http(s)://``, ``s3://``, ``pipe:``; ranged and parallel reads; manifests read from any location."""
