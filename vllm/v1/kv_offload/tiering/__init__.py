"""Multi-tier offloading (upstream v0.22's ``kv_offload.tiering``): a CPU primary tier that the
GPU reads and writes, and secondary tiers (e.g. the file system, :mod:`.fs`) that only exchange
blocks with the primary tier."""
