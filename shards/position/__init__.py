"""Position: the cursor, saved loader states and their one validator, elastic replay, step lineage and the DCP adapter."""
