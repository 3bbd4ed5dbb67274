"""Byte-size constants (upstream's names)."""

MB_bytes = 1_000_000
"""One megabyte (10^6 bytes)."""
MiB_bytes = 1 << 20
"""One mebibyte (2^20 bytes)."""
GB_bytes = 1_000_000_000
"""One gigabyte (10^9 bytes)."""
GiB_bytes = 1 << 30
"""One gibibyte (2^30 bytes)."""
