"""HiSparse constants shared by its planning and runtime."""

ACTIVE_TAIL_PAGES = 2
"""Sealed pages this far behind a request's block-table tail stay pinned on the device: a page
an in-flight step still writes is never spilled under it."""
