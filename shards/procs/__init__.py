"""Process-shared primitives: numbers, stage clocks and worker status in shared memory, below every folder that uses
them (the datasets in DataLoader workers, the node cache, the loaders and their watchdog)."""
