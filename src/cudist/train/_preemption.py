"""``PreemptionCheckpointHandler`` and ``TerminationConfig`` (``tf.distribute.experimental``'s, TF 2.21).

How a preemption is handled. A SIGTERM (or a ``termination_watcher_fn`` that returns True) only
sets a flag. At the start of every :meth:`PreemptionCheckpointHandler.run` (and in
:meth:`~PreemptionCheckpointHandler.save_checkpoint_if_preempted`) each worker starts a
non-blocking all-reduce (MAX of one int64, on a communicator of the handler's own) of its flag, and
completes the one it started at the previous call, which has had a whole step to finish: every
worker gets the same answer at the same call, whichever worker was signalled, for the cost of
starting and completing a small request (its round trip at most, where the step makes no MPI
calls that move it along). The notice thus acts one call after it is seen, as in TF (whose
workers agree through its coordination service): a notice seen at call k saves at call k+1.
Then every worker saves (the chief writes; the others take part in the save's collectives, the
multi-worker checkpoint rule of :class:`cudist.train.Checkpoint`), waits for a pending asynchronous
write, meets the others at a barrier (so no worker's exit ends the job before the chief's write is
committed), and calls ``exit_fn`` (by default ``sys.exit(42)``, TF's default outside Google Cloud),
which ``python -m cudist.launch --max-restarts N`` restarts. On restart the handler restores the
latest checkpoint and :attr:`~PreemptionCheckpointHandler.total_run_calls` continues from the saved
count.

Where cudist differs from TF, deliberately: TF updates the saved run count only when it saves on a preemption;
cudist keeps the ``checkpointed_runs`` variable current after every call, so a periodic save of
the same checkpoint (for a worker that is killed without notice, SIGKILL) resumes at the right
count too. Non-chief workers write nothing (cudist's rule), so no ``workertemp_<id>`` directories.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import numpy as np

from cudist._dataplane.transports import mpi
from cudist._variables import VariableAggregation, VariableSynchronization, create_plain_variable
from cudist.errors import InvalidArgumentError
from cudist.train._checkpoint import Checkpoint
from cudist.train._manager import CheckpointManager

__all__ = ["PreemptionCheckpointHandler", "TerminationConfig", "RESTART_EXIT_CODE"]

_log = logging.getLogger("cudist")

#: The exit code of the default ``exit_fn`` (TF's default ``sys.exit(42)``).
RESTART_EXIT_CODE = 42
_ITERATION_VARIABLE = "checkpointed_runs"  # TF's name for the saved run count
#: How often a ``termination_watcher_fn`` is polled (TF polls it every second).
_POLL_SECONDS = 1.0
# Values of the per-call agreement: none, a preemption noticed, its grace period over (exit now).
_NONE, _NOTICED, _EXIT = 0, 1, 2


def _default_exit() -> NoReturn:
    sys.exit(RESTART_EXIT_CODE)


class TerminationConfig:
    """How a :class:`PreemptionCheckpointHandler` learns of a preemption and ends (TF's ``TerminationConfig``).

    Args:
        termination_watcher_fn: a function returning True once a preemption notice is available
            (polled every second in a background thread, instead of watching for SIGTERM). It must
            not block.
        exit_fn: called after the preemption checkpoint is saved; by default ``sys.exit(42)``. The
            launcher (``python -m cudist.launch --max-restarts N``) restarts a job on any abnormal
            exit, this one included.
        grace_period: seconds between the notice and the actual preemption. With a positive grace
            period the handler saves at once, keeps training, and saves again and exits when the
            time (less a margin of six estimated steps, TF's rule) is nearly up. 0 (the default)
            saves and exits at once.
        save_fn: called instead of ``CheckpointManager.save`` to save (with the arguments given to
            :meth:`PreemptionCheckpointHandler.save_checkpoint_if_preempted`).
    """

    def __init__(
        self,
        termination_watcher_fn: Callable[[], bool] | None = None,
        exit_fn: Callable[[], Any] | None = None,
        grace_period: float | None = None,
        save_fn: Callable[..., Any] | None = None,
    ) -> None:
        self.termination_watcher_fn = termination_watcher_fn
        self.exit_fn = exit_fn
        self.grace_period = grace_period
        self.save_fn = save_fn


class PreemptionCheckpointHandler:
    """Saves a checkpoint and exits when any worker is preempted; restores it on restart (TF's).

    ::

        checkpoint = cudist.train.Checkpoint(model=model, optimizer=optimizer, iterator=iterator)
        handler = cudist.train.experimental.PreemptionCheckpointHandler(
            strategy.cluster_resolver, checkpoint, checkpoint_dir="/tmp/run")  # restores the latest
        for step in range(handler.total_run_calls, STEPS):
            loss = handler.run(train_step, iterator)

    Run the job with ``python -m cudist.launch -n 2 --max-restarts 3 train.py``: a SIGTERM to any
    worker makes every worker save at the same step and exit with code 42; the launcher starts the
    job again and the handler resumes it. See the module docstring for how the workers agree.

    Args:
        cluster_resolver: the job's cluster resolver (``strategy.cluster_resolver``), or None for
            a single-process job. A cluster with a ``ps`` job is not supported (as in TF).
        checkpoint_or_checkpoint_manager: a :class:`cudist.train.CheckpointManager`, or a
            :class:`cudist.train.Checkpoint` (then ``checkpoint_dir`` is required and a manager
            keeping one checkpoint is made there).
        checkpoint_dir: where to save and restore, with a :class:`~cudist.train.Checkpoint`.
        termination_config: a :class:`TerminationConfig`.

    Raises:
        cudist.errors.InvalidArgumentError: a Checkpoint without ``checkpoint_dir``.
        NotImplementedError: a cluster with a ``ps`` job.
        TypeError: neither a Checkpoint nor a CheckpointManager.
        ValueError: SIGTERM is to be watched (no ``termination_watcher_fn``) but the handler is
            created outside the main thread (Python's signal rule).
    """

    def __init__(
        self,
        cluster_resolver: Any,
        checkpoint_or_checkpoint_manager: Checkpoint | CheckpointManager,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        termination_config: TerminationConfig | None = None,
    ) -> None:
        if isinstance(checkpoint_or_checkpoint_manager, Checkpoint) and not checkpoint_dir:
            raise InvalidArgumentError(None, None, "When a checkpoint is passed, a checkpoint_dir must be passed as well.")
        if not isinstance(checkpoint_or_checkpoint_manager, (Checkpoint, CheckpointManager)):
            raise TypeError(
                "checkpoint_or_checkpoint_manager must be a cudist.train.Checkpoint or CheckpointManager, got "
                f"{type(checkpoint_or_checkpoint_manager).__name__}"
            )
        if cluster_resolver is not None and "ps" in cluster_resolver.cluster_spec().as_dict():
            raise NotImplementedError(
                "PreemptionCheckpointHandler does not support usage with a parameter-server cluster (a 'ps' job)."
            )
        config = termination_config or TerminationConfig()
        if config.termination_watcher_fn is None and threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "PreemptionCheckpointHandler watches for SIGTERM, and Python installs signal handlers only in the "
                "main thread: create it there, or give TerminationConfig(termination_watcher_fn=...)"
            )
        self._cluster_resolver = cluster_resolver
        self._termination_config = termination_config
        self._watcher_fn = config.termination_watcher_fn
        self._exit_fn: Callable[[], Any] = config.exit_fn or _default_exit
        self._grace_period = float(config.grace_period or 0)
        self._save_fn = config.save_fn
        self._checkpoint_dir = None if checkpoint_dir is None else os.fspath(checkpoint_dir)

        if isinstance(checkpoint_or_checkpoint_manager, CheckpointManager):
            self._manager = checkpoint_or_checkpoint_manager
            self._api_made_checkpoint_manager = False
        else:
            assert self._checkpoint_dir is not None
            # One manager on every worker: only the chief writes (Checkpoint's multi-worker rule).
            self._manager = CheckpointManager(checkpoint_or_checkpoint_manager, self._checkpoint_dir, max_to_keep=1)
            self._api_made_checkpoint_manager = True
        checkpoint = self._manager.checkpoint
        existing = getattr(checkpoint, _ITERATION_VARIABLE, None)
        if existing is None:
            existing = create_plain_variable(
                None,
                initial_value=np.int64(0),
                trainable=False,
                name=_ITERATION_VARIABLE,
                dtype=np.int64,
                synchronization=VariableSynchronization.AUTO,
                aggregation=VariableAggregation.NONE,
                shape=None,
                device="/cpu:0",
            )
            setattr(checkpoint, _ITERATION_VARIABLE, existing)
        self._checkpointed_runs: Any = existing
        self._manager.restore_or_initialize()
        self._run_counter = int(self._checkpointed_runs)

        self._comm = mpi.job()  # None in a single-process job: the agreement is local
        self._local_mode = self._comm is None
        self._previous = _NONE  # the state this worker sent at the previous call (local mode: the answer)
        self._request: Any = None  # (request, receive buffer, send buffer) of the previous call's all-reduce
        self._agree_comm: Any = None
        self._mpi_max: Any = None
        if self._comm is not None:
            MPI, _ = mpi.load()
            assert MPI is not None  # a job communicator exists only with mpi4py
            self._mpi_max = MPI.MAX
            # A communicator of its own (a collective: every worker creates the handler at the same
            # point), so the pending request never interleaves with the strategy's collectives.
            self._agree_comm = self._comm.comm.Dup()
            atexit.register(self._complete_request)  # before MPI finalizes (atexit runs last-in first)
        self._received_own_sigterm = threading.Event()
        self._received_own_sigterm_time = 0.0
        self._saved_for_notice = False  # with a grace period: the first (early) save is done
        self._estimated_run_time = 0.0
        self._stop_polling = threading.Event()
        self._poll_thread: threading.Thread | None = None
        if self._watcher_fn is not None:
            self._poll_thread = threading.Thread(
                target=self._poll_termination_signal, name="cudist-termination-watcher", daemon=True
            )
            self._poll_thread.start()
        else:
            signal.signal(signal.SIGTERM, self._sigterm_handler_fn)

    # -- the notice
    def _sigterm_handler_fn(self, signum: int, frame: types.FrameType | None) -> None:
        self._notice()

    def _notice(self) -> None:
        if not self._received_own_sigterm.is_set():
            self._received_own_sigterm_time = time.time()
            self._received_own_sigterm.set()
            _log.info("PreemptionCheckpointHandler: termination notice received")

    def _poll_termination_signal(self) -> None:
        assert self._watcher_fn is not None
        while not self._stop_polling.wait(_POLL_SECONDS):
            try:
                if self._watcher_fn():
                    self._notice()
                    return
            except Exception as e:  # a broken watcher must not kill training silently: logged, polled again
                _log.warning("termination_watcher_fn raised %r", e)

    def _local_state(self) -> int:
        if not self._received_own_sigterm.is_set():
            return _NONE
        if self._grace_period <= 0:
            return _EXIT
        # TF's margin: stop with time for three runs of the last step, twice over.
        deadline = self._received_own_sigterm_time + self._grace_period - 3 * self._estimated_run_time * 2
        return _EXIT if time.time() >= deadline else _NOTICED

    def _agree(self) -> int:
        """The job's state as of the previous call (the same on every worker), and this call's sent on."""
        state = self._local_state()
        if self._agree_comm is None:
            agreed, self._previous = self._previous, state
            return agreed
        agreed = self._complete_request()
        if agreed != _EXIT:  # training goes on: this call's flags travel during the step
            send = np.array([state], np.int64)
            recv = np.zeros(1, np.int64)
            self._request = (self._agree_comm.Iallreduce(send, recv, self._mpi_max), recv, send)
        return agreed

    def _complete_request(self) -> int:
        """Completes the all-reduce of the previous call; its MAX (``_NONE`` if there was none)."""
        pending, self._request = self._request, None
        if pending is None:
            return _NONE
        request, recv, _ = pending
        request.Wait()
        return int(recv[0])

    # -- the API
    @property
    def total_run_calls(self) -> int:
        """How many times :meth:`run` was called, counting the calls before a restart (saved with
        the checkpoint as ``checkpointed_runs``)."""
        return self._run_counter

    def run(self, distributed_train_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``distributed_train_function(*args, **kwargs)`` (a step), handling a preemption first.

        If any worker has received a termination notice, every worker saves a checkpoint here and
        calls ``exit_fn`` instead of running the step.

        Args:
            distributed_train_function: a (single-step) distributed training function.
            *args: its positional arguments.
            **kwargs: its keyword arguments.

        Returns:
            What ``distributed_train_function`` returns.
        """
        self._check_preemption_and_maybe_checkpoint()
        begin = time.time()
        result = distributed_train_function(*args, **kwargs)
        self._count_run(time.time() - begin)
        return result

    def _count_run(self, seconds: float | None) -> None:
        self._run_counter += 1
        # Kept current (TF assigns it only at a preemption save) so that any save records the count.
        self._checkpointed_runs.assign(self._run_counter, read_value=False)
        if seconds is None:
            self._estimated_run_time = 0.0
        else:
            self._estimated_run_time += (seconds - self._estimated_run_time) / self._run_counter

    def save_checkpoint_if_preempted(self, *args: Any, **kwargs: Any) -> None:
        """Saves a checkpoint and calls ``exit_fn`` if any worker has received a termination notice
        (the alternative to :meth:`run` for loops that step on their own); counts as one run call.

        Args:
            *args: passed to ``CheckpointManager.save`` (or ``save_fn``).
            **kwargs: passed to ``CheckpointManager.save`` (or ``save_fn``).
        """
        self._check_preemption_and_maybe_checkpoint(*args, **kwargs)
        self._count_run(None)

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """A scope for training calls (TF's, for TPUStrategy; with other strategies it adds nothing:
        errors propagate unchanged, a worker's error ends the whole job through the launcher)."""
        yield

    def _check_preemption_and_maybe_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        state = self._agree()
        if state == _NONE:
            return
        if state == _NOTICED:  # a grace period: save once now, keep training until it nearly ends
            if not self._saved_for_notice:
                self._save_checkpoint(*args, **kwargs)
                self._saved_for_notice = True
            return
        self._save_checkpoint(*args, **kwargs)
        self._stop_polling.set()
        if self._comm is not None:
            # Nobody exits (which ends the MPI job) before the chief's checkpoint is committed.
            self._comm.barrier("preemption checkpoint saved")
        _log.info("PreemptionCheckpointHandler: checkpoint saved at run %d; exiting", self._run_counter)
        self._exit_fn()

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        self._checkpointed_runs.assign(self._run_counter, read_value=False)
        if self._save_fn is not None:
            self._save_fn(*args, **kwargs)
        else:
            self._manager.save(*args, **kwargs)
        self._manager.sync()  # an asynchronous save (options=...) must be on disk before the exit

    def __repr__(self) -> str:
        return f"<cudist.train.experimental.PreemptionCheckpointHandler runs={self._run_counter} manager={self._manager!r}>"
