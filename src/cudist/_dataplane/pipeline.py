"""The communication thread of a pipelined reduction: cross-worker collectives run in order on a
thread of their own while the caller's thread works on the packs before and after them.

``MultiWorkerMirroredStrategy`` with ``CUDIST_PIPELINE_UPDATE=on`` (see
``CollectiveAllReduce._pipelined_sums``) hands each pack's cross-worker all-reduce here and
meanwhile sums the next pack over its local replicas and applies the previous pack's update.

The transports stay single-threaded: while a :class:`CommThread` is open, it is the ONLY thread of
the process that makes cross-worker collectives (the caller's thread does local kernel work only),
and the shared-memory protocol never sees two threads of one worker. MPI is initialized at
``MPI_THREAD_MULTIPLE`` by mpi4py (a collective from a thread other than the main one is allowed).

Failure contract: a collective's exception is re-raised in the caller, the same object (type and
message), by :meth:`CommThread.wait`; the collectives queued after a failed one are not run (the
communicator refuses them anyway); :meth:`CommThread.close` joins the thread, so none outlives the
call that opened it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["CommThread", "Job"]

#: How long :meth:`CommThread.close` waits for the thread after the caller failed (the collective in
#: flight may wait for a peer that never comes; its own deadline ends it, and the thread is a daemon).
_ABANDON_SECONDS = 5.0


class Job:
    """One queued collective: its result or its exception once :attr:`done` is set."""

    __slots__ = ("fn", "done", "result", "error")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class CommThread:
    """Runs submitted functions (cross-worker collectives) one at a time, in submission order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._failed: BaseException | None = None
        self._cancelled = False
        self._thread = threading.Thread(target=self._loop, name="cudist-comm", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._failed is not None or self._cancelled:
                # Not run: after a failed collective the communicator refuses the next ones, and
                # after the caller's failure nobody reads the result.
                job.error = self._failed or RuntimeError("cudist: the pipelined reduction was cancelled")
            else:
                try:
                    job.result = job.fn()
                except BaseException as e:  # noqa: BLE001 - handed to the caller, which re-raises it
                    job.error = e
                    self._failed = e
            job.done.set()

    def submit(self, fn: Callable[[], Any]) -> Job:
        """Queues ``fn`` behind the collectives submitted before it."""
        job = Job(fn)
        self._jobs.put(job)
        return job

    @staticmethod
    def wait(job: Job) -> Any:
        """``job``'s result, once it ran; its exception re-raised in the caller's thread."""
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def close(self, failed: bool = False) -> None:
        """Ends the thread: after the queued collectives ran (``failed``: the caller failed, the ones
        not started are dropped and the wait for the one in flight is bounded)."""
        if failed:
            self._cancelled = True
        self._jobs.put(None)
        self._thread.join(_ABANDON_SECONDS if failed else None)

    @property
    def alive(self) -> bool:
        """Whether the thread still runs (for tests)."""
        return self._thread.is_alive()
