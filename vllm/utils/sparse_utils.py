"""Safe handling of client-supplied sparse tensors (upstream v0.33's ``utils/sparse_utils``).

``torch.sparse.check_sparse_tensor_invariants()`` flips a process-wide flag on entry and
restores it on exit, so two threads checking at once can switch the check off under each
other: :func:`check_sparse_tensor_invariants_threadsafe` holds a lock around it.
:func:`safe_to_dense` bounds the memory densifying a tensor may take: a sparse tensor declares
its own shape, so a few bytes of payload can ask for gigabytes once dense.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

import vllm.envs as envs
from vllm.utils.mem_constants import MiB_bytes

__all__ = [
    "check_sparse_tensor_invariants_threadsafe",
    "safe_to_dense",
]


_SPARSE_LOAD_LOCK = threading.Lock()


@contextlib.contextmanager
def check_sparse_tensor_invariants_threadsafe() -> Iterator[None]:
    """``torch.sparse.check_sparse_tensor_invariants()`` serialized behind one lock."""
    with _SPARSE_LOAD_LOCK, torch.sparse.check_sparse_tensor_invariants():
        yield


def safe_to_dense(tensor: object, *, parameter: str) -> torch.Tensor:
    """``tensor`` densified, refused before anything is allocated when its declared dense size
    exceeds ``VLLM_MAX_EMBED_DECODE_BYTES`` (:mod:`vllm.envs`; 0: no limit). ``parameter``
    names the request field in the error. ``TypeError`` when the payload is not a tensor,
    ``ValueError`` when it is too large (upstream raises its ``VLLMValidationError``, which
    this library does not ship)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"{parameter}: expected the payload to deserialize to a torch.Tensor, got "
            f"{type(tensor).__name__}"
        )
    limit = envs.VLLM_MAX_EMBED_DECODE_BYTES
    dense_bytes = tensor.numel() * tensor.element_size()
    if 0 < limit < dense_bytes:
        raise ValueError(
            f"{parameter}: expected at most {limit} bytes once densified "
            f"(VLLM_MAX_EMBED_DECODE_BYTES), got shape {tuple(tensor.shape)}: {dense_bytes} "
            f"bytes ({dense_bytes / MiB_bytes:.0f} MiB)"
        )
    return tensor.to_dense()
