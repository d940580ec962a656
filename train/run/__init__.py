"""A training run: the loop, epochs, the run folder, checkpoints, the data-wait meter, first batch, curves and lineage."""
