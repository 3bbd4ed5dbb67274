"""Offloading to CPU memory: the spec, its load/store spec and the CPU <-> GPU handlers."""
