"""Tables packed straight into feature shards (``pack-shards --table``): options, reading, the fitted encoding, the writer."""
