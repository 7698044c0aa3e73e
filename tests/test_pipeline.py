"""The pipelined optimizer step of multi-worker jobs (``CUDIST_PIPELINE_UPDATE=on``).

* the communication thread (``cudist._dataplane.pipeline.CommThread``), in one process: order,
  results, an exception re-raised in the caller as the same object, nothing run after a failure,
  no thread left after ``close``;
* real MPI jobs (``python -m cudist.launch -n N``, under a timeout): a model of odd-sized float32 and
  bfloat16 variables trained pipelined equals the unpipelined step bit for bit with one, two and many
  packs, 1 and 2 local replicas, over shared memory, over MPI and over 2 simulated hosts x 2 workers
  (and MirroredStrategy's bits with one replica per worker on one node); no communication thread left;
* a worker that raises, is killed or hangs inside the shared-memory protocol mid-pipeline ends the job
  as the unpipelined step does: the same error, named, within the same deadlines; nothing in /dev/shm.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

import test_multi_worker as tmw
from cudist import _settings
from cudist._dataplane.pipeline import CommThread
from test_shm_transport import EVERY_SIZE, PROTOCOL_FAILURES, _launch, _results

needs_mpi = tmw.needs_mpi
no_shm_left = tmw.no_shm_left


# ---------------------------------------------------------------------------------------------- the thread
def test_the_thread_runs_in_order_and_hands_back_results():
    comm = CommThread()
    seen: list[int] = []
    jobs = [comm.submit(lambda i=i: (seen.append(i), threading.current_thread().name)[1]) for i in range(5)]
    assert [CommThread.wait(j) for j in jobs] == ["cudist-comm"] * 5  # on its own thread
    assert seen == [0, 1, 2, 3, 4]
    comm.close()
    assert not comm.alive


def test_an_exception_is_reraised_in_the_caller_and_later_jobs_do_not_run():
    comm = CommThread()
    error = ZeroDivisionError("collective #3 failed on purpose")
    ran: list[int] = []

    def fail():
        raise error

    first = comm.submit(lambda: ran.append(1))
    bad = comm.submit(fail)
    after = comm.submit(lambda: ran.append(2))
    CommThread.wait(first)
    with pytest.raises(ZeroDivisionError, match="collective #3 failed on purpose") as info:
        CommThread.wait(bad)
    assert info.value is error  # the same object: type and message as the unpipelined call's
    with pytest.raises(ZeroDivisionError):
        CommThread.wait(after)  # not run: it reports the failure that stopped it
    assert ran == [1]
    comm.close(failed=True)
    assert not comm.alive


def test_close_after_the_callers_failure_drops_what_has_not_started():
    comm = CommThread()
    started = threading.Event()
    ran: list[int] = []
    comm.submit(lambda: (started.set(), time.sleep(0.2)))
    comm.submit(lambda: ran.append(1))
    started.wait(5)
    comm.close(failed=True)
    assert not comm.alive and ran == []


def test_the_setting(monkeypatch):
    monkeypatch.delenv(_settings.PIPELINE_UPDATE, raising=False)
    assert _settings.pipeline_update() is False
    monkeypatch.setenv(_settings.PIPELINE_UPDATE, "ON")
    assert _settings.pipeline_update() is True
    monkeypatch.setenv(_settings.PIPELINE_UPDATE, "yes")
    with pytest.raises(ValueError, match=r"\$CUDIST_PIPELINE_UPDATE='yes' is not one of off, on"):
        _settings.pipeline_update()


# ---------------------------------------------------------------------------------------------- results
@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize(
    ("workers", "replicas", "env"),
    [(2, 1, {}), (2, 2, {}), (2, 1, {"CUDIST_SHM_TRANSPORT": "off"}), (4, 1, {"CUDIST_NODE_SIZE": "2"})],
    ids=["shm", "shm-2-replicas", "mpi", "2x2-hosts"],
)
def test_the_pipelined_step_equals_the_unpipelined_one_bit_for_bit(workers, replicas, env, no_shm_left):
    proc, _ = _launch(workers, "pipeline", str(replicas), env={**EVERY_SIZE, **env}, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = _results(proc, workers)
    # every check ran: 3 optimizers x (6 + 8 + 8 variables) x 2 comparisons, 2 call counts per pack setting,
    # experimental_aggregate_gradients=False, the threads
    assert len(results[0]) == 3 * 22 * 2 + 3 * 2 + 2


# ---------------------------------------------------------------------------------------------- failures
def _failing(mode, pipelined):
    env = {**EVERY_SIZE, "CUDIST_STALL_WARNING_SECONDS": "1"}
    return _launch(2, "pipeline_failing", mode, pipelined, env=env, timeout=60)


@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize(("mode", "named"), PROTOCOL_FAILURES)
def test_a_worker_failing_mid_pipeline_ends_the_job_as_unpipelined(mode, named, no_shm_left):
    for pipelined in ("on", "off"):
        proc, took = _failing(mode, pipelined)
        assert proc.returncode != 0
        assert proc.stdout.count("READY") == 2 and "UNREACHABLE" not in proc.stdout, proc.stdout[-2000:]
        assert took < 15
        assert re.search(named, proc.stderr), (pipelined, proc.stderr[-2000:])


@needs_mpi
@pytest.mark.multi_worker
def test_a_worker_hanging_mid_pipeline_times_out_named(no_shm_left):
    proc, took = _failing("shm_hang", "on")
    assert proc.returncode != 0
    assert proc.stdout.count("READY") == 2 and "UNREACHABLE" not in proc.stdout, proc.stdout[-2000:]
    assert took < 2 + 10
    assert re.search(r"worker 0 raised DeadlineExceededError: cudist: worker 0 of 2 timed out after 2 s "
                     r"\(CommunicationOptions.timeout_seconds\) in batch_reduce SUM, collective #\d+: "
                     r"worker\(s\) \[1\] did not join it", proc.stderr), proc.stderr[-2000:]


def test_no_pipeline_without_a_thread_level_that_allows_it(monkeypatch):
    """Under MPI_THREAD_FUNNELED (only the main thread may call MPI) the setting is ignored, with a warning."""
    import cudist._collective_ops as ops

    class Funneled:
        THREAD_FUNNELED, THREAD_SERIALIZED, THREAD_MULTIPLE = 1, 2, 3

        @staticmethod
        def Query_thread():  # noqa: N802 - mpi4py's name
            return Funneled.THREAD_FUNNELED

    class Serialized(Funneled):
        @staticmethod
        def Query_thread():  # noqa: N802 - mpi4py's name
            return Funneled.THREAD_SERIALIZED

    monkeypatch.setattr(ops, "mpi_load", lambda: (Funneled, None))
    with pytest.warns(RuntimeWarning, match="CUDIST_PIPELINE_UPDATE=on is ignored: MPI was initialized below"):
        assert ops._threaded_mpi() is False
    monkeypatch.setattr(ops, "mpi_load", lambda: (Serialized, None))
    assert ops._threaded_mpi() is True
