"""Scratch memory shared by a worker's kernels (upstream v0.33's ``vllm.v1.worker.workspace``).

A :class:`WorkspaceManager` owns one byte buffer per execution slot: a slot is a (micro-batch,
lane) pair, the micro-batch from :func:`dbo_current_ubatch_id` and the lane from
:func:`use_workspace_lane` (a speculative draft model runs in its own lane, so its scratch never
aliases the target's). :meth:`WorkspaceManager.get_simultaneous` carves several tensors out of
the current slot's buffer, growing it when a request needs more; persistent resources are kept
per slot under a key. After warm-up the manager is locked (:func:`lock_workspace`): CUDA graphs
captured then point into the buffers, so a request that would reallocate one, or a resource
not created during warm-up, is an ``AssertionError`` instead of a silent reallocation.

One manager per process (:func:`init_workspace_manager`); attention backends reserve their
scratch through :func:`current_workspace_manager` when :func:`is_workspace_manager_initialized`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import TypeVar, cast

import torch

__all__ = [
    "WorkspaceManager",
    "current_workspace_manager",
    "dbo_current_ubatch_id",
    "init_workspace_manager",
    "is_workspace_manager_initialized",
    "lock_workspace",
    "reset_workspace_manager",
    "unlock_workspace",
    "use_workspace_lane",
]

T = TypeVar("T")

WORKSPACE_ALIGNMENT = 256
"""Bytes each tensor of :meth:`WorkspaceManager.get_simultaneous` starts at a multiple of."""

_manager: WorkspaceManager | None = None
_lane: ContextVar[int] = ContextVar("vllm_workspace_lane", default=0)


def dbo_current_ubatch_id() -> int:
    """The micro-batch running in this thread: always 0 here (the library runs no dual-batch
    overlap; an engine that does replaces this name)."""
    return 0


@contextmanager
def use_workspace_lane(lane: int) -> Iterator[None]:
    """Run the block with ``lane``'s scratch (its own buffer and resources); restored after."""
    if lane < 0:
        raise ValueError(f"lane: expected a non-negative lane, got {lane}")
    token = _lane.set(lane)
    try:
        yield
    finally:
        _lane.reset(token)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class WorkspaceManager:
    """Scratch buffers and keyed persistent resources per (micro-batch, lane) slot, on
    ``device``. ``alloc_context`` is entered around each buffer allocation (e.g. a memory
    pool)."""

    def __init__(
        self,
        device: torch.device,
        num_ubatches: int | None = None,
        num_lanes: int = 1,
        alloc_context: Callable[[], AbstractContextManager] = nullcontext,
    ) -> None:
        if num_lanes < 1:
            raise ValueError(f"num_lanes: expected at least one lane, got {num_lanes}")
        num_ubatches = 1 if num_ubatches is None else num_ubatches
        if num_ubatches < 1:
            raise ValueError(f"num_ubatches: expected at least one, got {num_ubatches}")
        self._device = torch.device(device)
        self._alloc_context = alloc_context
        self._num_lanes = num_lanes
        slots = num_ubatches * num_lanes
        self._current_workspaces: list[torch.Tensor | None] = [None] * slots
        self._persistent_resources: list[dict[Hashable, object]] = [{} for _ in range(slots)]
        self._locked = False

    def lock(self) -> None:
        """Forbid growing a buffer and creating a resource (after warm-up)."""
        self._locked = True

    def unlock(self) -> None:
        """Allow growth again (e.g. while the engine rescales)."""
        self._locked = False

    def is_locked(self) -> bool:
        return self._locked

    def _slot(self) -> int:
        lane = _lane.get()
        if lane >= self._num_lanes:
            raise RuntimeError(
                f"workspace lane {lane} is not configured: the manager has {self._num_lanes} "
                "lane(s)"
            )
        slot = dbo_current_ubatch_id() * self._num_lanes + lane
        if not 0 <= slot < len(self._current_workspaces):
            raise RuntimeError(f"workspace micro-batch {dbo_current_ubatch_id()} is not configured")
        return slot

    def get_persistent_resource(self, key: Hashable, factory: Callable[[], T]) -> T:
        """The current slot's resource under ``key``: made by ``factory`` on the first request,
        the same object afterwards. Locked: a key the slot does not hold is an
        ``AssertionError``."""
        resources = self._persistent_resources[self._slot()]
        if key not in resources:
            if self._locked:
                raise AssertionError(
                    f"Workspace is locked but {key!r} was not allocated during warmup for this "
                    "micro-batch and lane"
                )
            resources[key] = factory()
        return cast(T, resources[key])

    def get_persistent(
        self,
        key: Hashable,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        zero_init: bool = False,
    ) -> torch.Tensor:
        """A tensor of ``shape`` / ``dtype`` kept under ``key`` (zeroed when first made if
        ``zero_init``); ``ValueError`` when ``key`` holds another shape or dtype."""
        make = torch.zeros if zero_init else torch.empty
        tensor = self.get_persistent_resource(
            (torch.Tensor, key), lambda: make(shape, dtype=dtype, device=self._device)
        )
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(
                f"shape, dtype: persistent workspace {key!r} holds shape={tuple(tensor.shape)}, "
                f"dtype={tensor.dtype}; requested shape={tuple(shape)}, dtype={dtype}"
            )
        return tensor

    def get_simultaneous(
        self, *shapes_and_dtypes: tuple[tuple[int, ...], torch.dtype]
    ) -> list[torch.Tensor]:
        """One tensor per ``(shape, dtype)``, all views of the current slot's buffer that do not
        overlap (each starting at a multiple of :data:`WORKSPACE_ALIGNMENT` bytes). They alias
        the tensors of the slot's previous call: scratch, valid until the next one."""
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in shapes_and_dtypes]
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += _round_up(size, WORKSPACE_ALIGNMENT)
        buffer = self._buffer_of_at_least(total)
        return [
            buffer[offset : offset + size].view(dtype).reshape(shape)
            for offset, size, (shape, dtype) in zip(offsets, sizes, shapes_and_dtypes, strict=True)
        ]

    def _buffer_of_at_least(self, nbytes: int) -> torch.Tensor:
        slot = self._slot()
        buffer = self._current_workspaces[slot]
        have = 0 if buffer is None else buffer.numel()
        if have >= nbytes:
            assert buffer is not None
            return buffer
        if self._locked:
            raise AssertionError(
                f"Workspace is locked but a request needs {nbytes} bytes, the buffer holds "
                f"{have}: growth after locking would move memory that captured graphs use"
            )
        self._current_workspaces[slot] = None  # the old buffer goes before the new one comes
        del buffer
        with self._alloc_context():
            grown = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        self._current_workspaces[slot] = grown
        return grown


def is_workspace_manager_initialized() -> bool:
    """Whether :func:`init_workspace_manager` made this process's manager."""
    return _manager is not None


def current_workspace_manager() -> WorkspaceManager:
    """This process's manager; ``AssertionError`` before :func:`init_workspace_manager`."""
    assert _manager is not None, (
        "WorkspaceManager not initialized: call init_workspace_manager(device) first"
    )
    return _manager


def init_workspace_manager(
    device: torch.device,
    num_ubatches: int | None = None,
    num_lanes: int = 1,
    alloc_context: Callable[[], AbstractContextManager] = nullcontext,
) -> None:
    """Make this process's manager (replacing any earlier one)."""
    global _manager
    _manager = WorkspaceManager(device, num_ubatches, num_lanes, alloc_context)


def lock_workspace() -> None:
    """Lock this process's manager (after warm-up)."""
    current_workspace_manager().lock()


def unlock_workspace() -> None:
    """Unlock this process's manager."""
    current_workspace_manager().unlock()


def reset_workspace_manager() -> None:
    """Forget this process's manager (tests)."""
    global _manager
    _manager = None
