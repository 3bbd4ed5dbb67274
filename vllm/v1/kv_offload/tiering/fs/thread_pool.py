"""The I/O threads of a secondary tier (the file-system and Mooncake tiers): a load queue, a
store queue and two thread groups.

Load-first threads take from the load queue while it has work and otherwise from the store
queue; store-first threads the other way round, so neither direction starves the other. A job
is a set of per-block tasks; it finishes when its last task does, failed if any task raised.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple

from vllm.v1.kv_offload.tiering.base import JobId

logger = logging.getLogger(__name__)

Task = Callable[[], object]


class FinishedJob(NamedTuple):
    """A job whose last task finished: ``success`` is False if any task raised (or the job was
    dropped by :meth:`DualQueueThreadPool.shutdown`); ``transfer_time`` sums its tasks' run
    times (seconds)."""

    job_id: JobId
    success: bool
    transfer_time: float


class JobState:
    """Counts a job's finished tasks (thread-safe)."""

    __slots__ = ("_completed", "_job_id", "_lock", "_n_tasks", "_success", "_time")

    def __init__(self, job_id: JobId, n_tasks: int) -> None:
        self._job_id: JobId = job_id
        self._n_tasks = n_tasks
        self._completed = 0
        self._success = True
        self._time = 0.0
        self._lock = threading.Lock()

    @property
    def job_id(self) -> JobId:
        return self._job_id

    def task_done(self, success: bool, seconds: float) -> FinishedJob | None:
        """Record one finished task that ran ``seconds``: the job, once this was its last."""
        with self._lock:
            self._completed += 1
            self._success = self._success and success
            self._time += seconds
            if self._completed != self._n_tasks:
                return None
            return FinishedJob(self._job_id, self._success, self._time)


class DualQueueThreadPool:
    """``n_read_threads`` load-first and ``n_write_threads`` store-first daemon threads."""

    def __init__(
        self, n_read_threads: int, n_write_threads: int, thread_name_prefix: str = "fs_tier"
    ) -> None:
        if n_read_threads < 0 or n_write_threads < 0 or n_read_threads + n_write_threads == 0:
            raise ValueError(
                f"n_read_threads, n_write_threads: expected >= 0 and at least 1 thread, got "
                f"{n_read_threads}, {n_write_threads}"
            )
        self._load_q: deque[tuple[Task, JobState]] = deque()
        self._store_q: deque[tuple[Task, JobState]] = deque()
        self._condition = threading.Condition(threading.Lock())
        self._stop = False
        self._finished_q: deque[FinishedJob] = deque()
        self._inflight_jobs = 0  # guarded by _condition
        self._threads: list[threading.Thread] = []
        self._name = thread_name_prefix
        groups = ((True, "l", n_read_threads), (False, "s", n_write_threads))
        for load_first, tag, count in groups:
            for i in range(count):
                thread = threading.Thread(
                    target=self._worker,
                    args=(load_first,),
                    name=f"{thread_name_prefix}_{tag}{i}",
                    daemon=True,
                )
                thread.start()
                self._threads.append(thread)

    def _enqueue(
        self,
        queue: deque[tuple[Task, JobState]],
        job_id: JobId,
        n_tasks: int,
        tasks: Iterable[Task],
    ) -> None:
        if n_tasks == 0:  # nothing to do: finished at once
            self._finished_q.append(FinishedJob(job_id, True, 0.0))
            return
        state = JobState(job_id, n_tasks)
        with self._condition:
            if self._stop:
                raise RuntimeError(f"job {job_id}: {self._name} is shut down")
            queue.extend((task, state) for task in tasks)
            self._inflight_jobs += 1
            self._condition.notify(n_tasks)

    def enqueue_load(self, job_id: JobId, n_tasks: int, tasks: Iterable[Task]) -> None:
        """Queue a load job of ``n_tasks`` tasks (``tasks`` yields exactly that many)."""
        self._enqueue(self._load_q, job_id, n_tasks, tasks)

    def enqueue_store(self, job_id: JobId, n_tasks: int, tasks: Iterable[Task]) -> None:
        """Queue a store job of ``n_tasks`` tasks (``tasks`` yields exactly that many)."""
        self._enqueue(self._store_q, job_id, n_tasks, tasks)

    def get_finished(self) -> list[FinishedJob]:
        """The jobs finished since the previous call (one caller; deques are thread-safe)."""
        finished = []
        while self._finished_q:
            finished.append(self._finished_q.popleft())
        return finished

    def wait_idle(self) -> None:
        """Block until every queued job has finished (its result waits in
        :meth:`get_finished`): no task is running then."""
        with self._condition:
            self._condition.wait_for(lambda: self._inflight_jobs == 0)

    def shutdown(self, wait: bool = True) -> None:
        """Drop queued tasks (their jobs are reported failed) and stop the threads (after
        their current task)."""
        with self._condition:
            self._stop = True
            dropped = {id(state): state for _, state in (*self._load_q, *self._store_q)}
            self._load_q.clear()
            self._store_q.clear()
            for state in dropped.values():
                self._finished_q.append(FinishedJob(state.job_id, False, 0.0))
            self._inflight_jobs -= len(dropped)
            self._condition.notify_all()
        if wait:
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join()

    def _worker(self, load_first: bool) -> None:
        first, second = (
            (self._load_q, self._store_q) if load_first else (self._store_q, self._load_q)
        )
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._stop or bool(first) or bool(second))
                if self._stop:
                    return
                task, state = (first or second).popleft()
            start = time.monotonic()
            try:
                task()
                ok = True
            except Exception as exc:
                logger.error("%s: job %s: block I/O failed: %s", self._name, state.job_id, exc)
                ok = False
            job = state.task_done(ok, time.monotonic() - start)
            if job is not None:
                with self._condition:
                    self._finished_q.append(job)
                    self._inflight_jobs -= 1
                    self._condition.notify_all()
