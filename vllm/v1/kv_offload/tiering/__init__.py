"""Multi-tier offloading (upstream v0.33's ``kv_offload.tiering``): a CPU primary tier that the
GPU reads and writes, and secondary tiers (the file system, :mod:`.fs`; object stores,
:mod:`.obj`; Mooncake, :mod:`.mooncake`, ...) that only exchange chunks with the primary tier."""
