"""HiSparse: sparse-MLA KV with its full history in a host pool (planning side)."""
