"""The loader: one ``Loader`` type with its run modes (worker processes under a watchdog, in-process), stage timing and faults."""
