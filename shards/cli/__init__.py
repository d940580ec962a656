"""The ``shards`` console script and what every console script shares (exit codes, options, JSON output)."""
