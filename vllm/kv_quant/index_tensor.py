"""The one rule for an index tensor: token positions, slot mappings, page ids (block tables),
sequence lengths and query offsets hold integers.

Indexing with a float tensor, ``.to(torch.int64)`` and ``int()`` truncate without a word, so a
fractional position or page id would read or write the wrong place: every entry point that
takes such a tensor checks it with :func:`check_integer_tensor` before anything is written.
(Here, at the bottom layer, because the key transform's RoPE takes token positions.)
"""

from __future__ import annotations

import torch


def check_integer_tensor(name: str, value: object) -> torch.Tensor:
    """``value`` when it is a tensor of an integer dtype; else ``ValueError`` naming ``name``."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name}: expected an integer tensor, got {type(value).__name__}")
    dtype = value.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise ValueError(f"{name}: expected an integer tensor, got {dtype}")
    return value
