"""Process-shared primitives: numbers, stage clocks and worker status in shared memory, and the signals a DataLoader
worker answers, below every folder that uses them (the datasets in DataLoader workers, the node cache, the loaders
and their watchdog)."""
