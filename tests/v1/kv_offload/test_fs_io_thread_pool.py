"""The file-system tier's :class:`DualQueueThreadPool`: job results with their run times, and
what shutdown does to queued jobs (upstream's tests cover priorities and ``wait_idle``)."""

from __future__ import annotations

import threading
import time

import pytest

from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool, FinishedJob


def wait_for(pool: DualQueueThreadPool, n: int) -> list[FinishedJob]:
    pool.wait_idle()
    finished = pool.get_finished()
    assert len(finished) == n
    return finished


def test_a_job_finishes_with_its_tasks_summed_time_and_fails_if_one_raises() -> None:
    pool = DualQueueThreadPool(1, 1)
    try:

        def boom() -> None:
            raise OSError("disk gone")

        pool.enqueue_store(1, 2, [lambda: time.sleep(0.05), lambda: time.sleep(0.05)])
        (ok,) = wait_for(pool, 1)
        assert ok.job_id == 1 and ok.success and ok.transfer_time >= 0.1
        pool.enqueue_load(2, 2, [lambda: None, boom])
        assert wait_for(pool, 1) == [FinishedJob(2, False, pytest.approx(0, abs=0.05))]
        pool.enqueue_load(3, 0, [])  # nothing to do: finished at once
        assert pool.get_finished() == [FinishedJob(3, True, 0.0)]
    finally:
        pool.shutdown()


def test_shutdown_reports_dropped_jobs_failed_and_refuses_new_ones() -> None:
    pool = DualQueueThreadPool(0, 1)
    gate = threading.Event()
    pool.enqueue_store(1, 1, [gate.wait])
    pool.enqueue_store(2, 2, [lambda: None, lambda: None])
    pool.enqueue_load(3, 1, [lambda: None])
    while len(pool._store_q) == 3:  # until the worker has taken job 1's task
        time.sleep(0.001)
    stopper = threading.Thread(target=pool.shutdown)
    stopper.start()
    while not pool._stop:  # the queues are dropped before the running task ends
        time.sleep(0.001)
    gate.set()
    stopper.join(timeout=5)
    assert not stopper.is_alive()
    finished = {job.job_id: job.success for job in pool.get_finished()}
    assert finished == {1: True, 2: False, 3: False}
    pool.wait_idle()  # nothing in flight: returns at once
    with pytest.raises(RuntimeError, match="job 4: fs_tier is shut down"):
        pool.enqueue_load(4, 1, [lambda: None])


@pytest.mark.parametrize(("reads", "writes"), [(0, 0), (-1, 2)])
def test_thread_counts_are_checked(reads: int, writes: int) -> None:
    with pytest.raises(ValueError, match="n_read_threads, n_write_threads: expected >= 0"):
        DualQueueThreadPool(reads, writes)
