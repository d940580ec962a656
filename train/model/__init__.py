"""What is trained and how it is scored: heads and models, the probe, standardising, regression, optimiser and metrics."""
