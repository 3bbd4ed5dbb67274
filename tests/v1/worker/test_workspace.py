"""The worker's scratch manager: slots per micro-batch and lane, growth, locking, persistent
resources, and the process-wide manager."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.worker import workspace
from vllm.v1.worker.workspace import WorkspaceManager, use_workspace_lane


def test_simultaneous_tensors_are_aligned_disjoint_views_of_one_buffer() -> None:
    manager = WorkspaceManager(torch.device("cpu"))
    a, b, c = manager.get_simultaneous(
        ((3, 5), torch.float32), ((7,), torch.float16), ((2, 2), torch.int64)
    )
    assert (a.shape, b.shape, c.shape) == ((3, 5), (7,), (2, 2))
    assert (a.dtype, b.dtype, c.dtype) == (torch.float32, torch.float16, torch.int64)
    base = a.data_ptr()
    assert (b.data_ptr() - base, c.data_ptr() - base) == (256, 512)  # 60 and 14 bytes, aligned
    (buffer,) = [w for w in manager._current_workspaces if w is not None]
    assert buffer.numel() == 768 and buffer.dtype == torch.uint8
    a.fill_(1.0), b.fill_(2.0), c.fill_(3)
    assert float(a.sum()) == 15.0 and float(b.sum()) == 14.0 and int(c.sum()) == 12


def test_growth_replaces_the_buffer_and_locking_forbids_it() -> None:
    manager = WorkspaceManager(torch.device("cpu"))
    (small,) = manager.get_simultaneous(((100,), torch.uint8))
    (again,) = manager.get_simultaneous(((256,), torch.uint8))
    assert again.data_ptr() == small.data_ptr()  # fits: the same buffer
    manager.lock()
    assert manager.is_locked()
    with pytest.raises(AssertionError, match="Workspace is locked but a request needs 512"):
        manager.get_simultaneous(((512,), torch.uint8))
    manager.unlock()
    (grown,) = manager.get_simultaneous(((512,), torch.uint8))
    assert grown.numel() == 512


def test_lanes_and_micro_batches_own_their_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    ubatch = [0]
    monkeypatch.setattr(workspace, "dbo_current_ubatch_id", lambda: ubatch[0])
    manager = WorkspaceManager(torch.device("cpu"), num_ubatches=2, num_lanes=2)
    seen = set()
    for ubatch[0] in (0, 1):
        for lane in (0, 1):
            with use_workspace_lane(lane):
                (t,) = manager.get_simultaneous(((16,), torch.uint8))
                seen.add(t.data_ptr())
    assert len(seen) == 4
    ubatch[0] = 2
    with pytest.raises(RuntimeError, match="micro-batch 2 is not configured"):
        manager.get_simultaneous(((1,), torch.uint8))


def test_bad_arguments() -> None:
    lane = pytest.raises(ValueError, match="lane: expected a non-negative lane, got -1")
    with lane, use_workspace_lane(-1):
        pass
    with pytest.raises(ValueError, match="num_lanes: expected at least one lane, got 0"):
        WorkspaceManager(torch.device("cpu"), num_lanes=0)
    with pytest.raises(ValueError, match="num_ubatches: expected at least one, got 0"):
        WorkspaceManager(torch.device("cpu"), num_ubatches=0)
    manager = WorkspaceManager(torch.device("cpu"))
    with use_workspace_lane(1), pytest.raises(RuntimeError, match="lane 1 is not configured"):
        manager.get_simultaneous(((1,), torch.uint8))


def test_persistent_tensors_keep_their_contents_and_refuse_another_shape() -> None:
    manager = WorkspaceManager(torch.device("cpu"))
    locks = manager.get_persistent("locks", (4,), torch.int32, zero_init=True)
    assert int(locks.count_nonzero()) == 0
    locks.fill_(7)
    manager.get_simultaneous(((4096,), torch.uint8))[0].zero_()  # scratch never aliases it
    assert manager.get_persistent("locks", (4,), torch.int32) is locks
    assert bool((locks == 7).all())
    with pytest.raises(ValueError, match=r"requested shape=\(8,\), dtype=torch.int32"):
        manager.get_persistent("locks", (8,), torch.int32)
    manager.lock()
    with pytest.raises(AssertionError, match="'new'.*was not allocated during warmup"):
        manager.get_persistent_resource("new", dict)


def test_the_process_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workspace, "_manager", None)
    assert not workspace.is_workspace_manager_initialized()
    with pytest.raises(AssertionError, match="call init_workspace_manager"):
        workspace.current_workspace_manager()
    workspace.init_workspace_manager(torch.device("cpu"), num_lanes=2)
    manager = workspace.current_workspace_manager()
    assert workspace.is_workspace_manager_initialized()
    workspace.lock_workspace()
    assert manager.is_locked()
    workspace.unlock_workspace()
    assert not manager.is_locked()
    workspace.reset_workspace_manager()
    assert not workspace.is_workspace_manager_initialized()
