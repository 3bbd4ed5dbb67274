"""Eviction policies of the CPU offloading manager: LRU (``lru``) and ARC (``arc``)."""
