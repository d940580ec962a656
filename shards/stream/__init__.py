"""Streaming: the epoch plan, the stages, epoch and resume state, the datasets, ``open_dataset`` and the loader."""
