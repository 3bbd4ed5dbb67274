"""GPU (and CPU) model-runner utilities."""
