"""Asynchronous checkpoint writes: ``cudist.train.CheckpointOptions(enable_async=True)`` (TF's name).

An asynchronous save captures the state in the caller's thread and writes it in a background one:

* capture, without a copy where it can: a host variable (or component) whose kernel backend updates
  out of place (the native backend: :meth:`cudist._dataplane.storage.Storage.capture`) is captured
  as its copy-on-write snapshot. The save call takes references only; the next update reads the
  held array and writes the new values into another one (the update kernels take separate input
  and output arrays: the same arithmetic, the same bits), which becomes the variable's storage;
  when the write has read the held array, it becomes that variable's next write buffer, already
  faulted in (fresh pages would cost ~450 ms per 256 MiB on the 2-core build machine, more than a
  synchronous save). So a variable and each slot keep two buffers in turn however many saves run.
  A rule whose kernel has no out-of-place form yet (see ``out_of_place`` of the trusted kernels, and
  a row with optional slots) copies the held array into the write buffer first: the same bits, the
  copy in that step rather than in the call;
* capture by copy otherwise: on the NumPy and Numba backends, for a component of a distributed
  variable, a dtype without kernels, the value is copied into a staging buffer that the checkpoint
  keeps from one save to the next (the kernel backend's multi-threaded copy); on a GPU the value is
  a device copy (``read_value()``), moved to the host by the background thread. Small things (the
  index records, ``save_counter``, an iterator's position, a sync-on-read variable's aggregate,
  which is a collective) are taken in the caller's thread too;
* write: :func:`cudist.train._format.write_checkpoint` in a background thread, the same atomic
  write as a synchronous save, byte for byte (tensors fsynced and renamed, then the index, the
  commit point): a crash or SIGKILL during it leaves the previous checkpoints intact. The tensors'
  bytes go to the file in native code without the GIL (``cudist._core.write_crc32``, one call per
  tensor; the Python loop it replaced took the GIL back ~500 times per 256 MiB), through the page
  cache, or with ``O_DIRECT`` through a 1 MiB bounce buffer where ``CUDIST_CHECKPOINT_DIRECT_IO=on``;
* priority: the thread first adds ``CUDIST_CHECKPOINT_WRITER_NICE`` (0, none, by default) to its
  own niceness (Linux keeps one per thread; :func:`lower_thread_priority`). Only that thread
  changes, and it ends with the write: nothing is restored, the caller's threads never change. The
  setting is read, and checked, by the save call. Why 0: on the shared 2-core build machine nice 10
  made the write ~3x longer and the loop beside it no faster within the noise (5 runs,
  ``bench/PERFORMANCE.md``);
* one write at a time per :class:`~cudist.train.Checkpoint`: a save waits for the previous one
  first, and raises its error, if it had one (as does ``sync()``, which waits for it);
* the thread is not a daemon: an interpreter that exits normally finishes the pending write first.

What the loop still pays (``bench/PERFORMANCE.md``, 256 MiB of variables and slots, the 2-core
build machine, a save every 40 single-threaded steps): the call (0.4% of a synchronous save), the
first update after it, which writes new buffers (~2%), and the write beside the steps: in all
10-13% of a synchronous save on a quiet machine, issue #29's 5% not met. What bounds it (the A/B of
``bench/async_checkpoint.py --ab``, one run, interleaved): not the GIL (the native writer and the
Python loop cost the loop the same within the noise), not the write's CPU while a core is spare (a
thread burning the same ~107 ms of CPU without memory traffic cost the loop 0.4-2%), and only in
part memory bandwidth (a plain copy of the 256 MiB beside it: 2-4%); the rest is the kernel's side
of ~256 MiB of file I/O (page cache, block layer, the disk's interrupts) on a 2-vCPU VM. The write
takes ~107 ms of thread CPU per 256 MiB through the page cache (the copy into it ~56-74 ms, the
CRC-32s ~20 ms, fsync ~10 ms), ~55 ms with ``O_DIRECT``; where other processes keep every core
busy that CPU is taken from the steps (there ``O_DIRECT`` cut the loop's cost by ~30%). A save that
comes before the previous write has ended waits for it.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cudist import _settings
from cudist._arrays import array_module, device_context, is_device_array, to_host
from cudist._kernels import SUPPORTED_DTYPES, backend_for

__all__ = ["AsyncWriter", "CheckpointOptions", "lower_thread_priority", "run_write_callbacks"]

_log = logging.getLogger("cudist")


class CheckpointOptions:
    """Options for ``Checkpoint.save``/``write`` and ``CheckpointManager.save`` (``tf.train.CheckpointOptions``).

    Args:
        experimental_io_device: accepted for TF compatibility; cudist reads and writes from the host
            (there is no device to route the I/O through), so it is ignored.
        experimental_enable_async_checkpoint: the older name of ``enable_async`` (either turns it on).
        experimental_write_callbacks: callables called after each checkpoint is committed, in order,
            with the checkpoint's path prefix if they take an argument (as TF). With ``enable_async``
            they run in the background thread.
        enable_async: write in a background thread: the save returns once the state is captured
            (host variables of the native backend: their copy-on-write snapshots, no copy; else
            copied into staging buffers the checkpoint keeps between saves). ``Checkpoint.sync()`` /
            ``CheckpointManager.sync()`` wait for the write; the next save waits for it too; an
            error in it is raised by the next save or ``sync()``.
        experimental_skip_slot_variables: save without the optimizers' slot variables.
        experimental_sharding_callback: accepted for TF compatibility; must be None (cudist writes
            one tensors file per checkpoint).

    Raises:
        ValueError: ``experimental_sharding_callback`` given.
    """

    def __init__(
        self,
        experimental_io_device: str | None = None,
        experimental_enable_async_checkpoint: bool = False,
        experimental_write_callbacks: Sequence[Callable[..., Any]] | None = None,
        enable_async: bool = False,
        experimental_skip_slot_variables: bool = False,
        experimental_sharding_callback: object = None,
    ) -> None:
        if experimental_sharding_callback is not None:
            raise ValueError(
                "experimental_sharding_callback is not supported: cudist writes one tensors file per checkpoint"
            )
        self.experimental_io_device = experimental_io_device
        self.experimental_enable_async_checkpoint = bool(experimental_enable_async_checkpoint)
        self.enable_async = bool(enable_async or experimental_enable_async_checkpoint)
        callbacks = list(experimental_write_callbacks or ())
        for cb in callbacks:
            if not callable(cb):
                raise TypeError(f"experimental_write_callbacks must hold callables, got {cb!r}")
        self.experimental_write_callbacks = callbacks
        self.experimental_skip_slot_variables = bool(experimental_skip_slot_variables)
        self.experimental_sharding_callback = None

    def __repr__(self) -> str:
        return (
            f"CheckpointOptions(enable_async={self.enable_async}, "
            f"experimental_skip_slot_variables={self.experimental_skip_slot_variables}, "
            f"experimental_write_callbacks={self.experimental_write_callbacks!r})"
        )


def check_options(options: object) -> CheckpointOptions | None:
    """``options`` as a :class:`CheckpointOptions` (None stays None).

    Raises:
        TypeError: ``options`` is neither None nor a :class:`CheckpointOptions`.
        ValueError: ``enable_async`` with a bad ``CUDIST_CHECKPOINT_WRITER_NICE`` (checked before
            the save changes anything).
    """
    if options is None or isinstance(options, CheckpointOptions):
        if options is not None and options.enable_async:
            _settings.checkpoint_writer_nice()
        return options
    raise TypeError(f"options must be a cudist.train.CheckpointOptions or None, got {type(options).__name__}")


def run_write_callbacks(options: CheckpointOptions | None, path: str) -> None:
    """Calls ``options.experimental_write_callbacks`` (TF: with the path if the callback takes an argument)."""
    if options is None:
        return
    for cb in options.experimental_write_callbacks:
        try:
            takes_path = bool(inspect.signature(cb).parameters)
        except (TypeError, ValueError):  # a builtin without a signature: give it the path
            takes_path = True
        if takes_path:
            cb(path)
        else:
            cb()


#: Below this, a plain NumPy copy (a kernel call's set-up would cost more than it saves).
_PARALLEL_COPY_BYTES = 1 << 20


def _identity(x: Any) -> Any:
    return x


def _device_to_host(value: Any, event: Any) -> np.ndarray:
    event.synchronize()
    with device_context(value):
        return to_host(value)


def lower_thread_priority(increment: int) -> None:
    """Adds ``increment`` to the calling thread's niceness (Linux, where niceness is per thread).

    Only the writer thread calls it, as its first act: the thread ends with the write, so nothing
    has to restore it (an unprivileged thread could not lower its niceness back anyway). Elsewhere
    (macOS: ``PRIO_PROCESS`` would renice the whole process) and on a refusal it does nothing.
    """
    if increment <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except OSError as e:  # a sandbox without setpriority: the write still runs, at the loop's priority
        _log.debug("could not lower the checkpoint writer's priority: %s", e)


#: Every writer with a thread started: at exit, a write that failed unobserved is logged.
_WRITERS: weakref.WeakSet[AsyncWriter] = weakref.WeakSet()


class AsyncWriter:
    """Runs one checkpoint's background writes, one at a time."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._staging: dict[str, np.ndarray] = {}  # tensor key -> its host buffer, reused by every save
        self._staged: set[str] = set()  # the keys the save being captured uses

    def stage(self, key: str, value: Any) -> Callable[[], Any]:
        """Captures ``value`` (a variable's ``read_value()`` or a host array) for the background write.

        Call only after :meth:`sync` (the buffers of the previous write are reused).

        Returns:
            The ``get`` of the tensor's spec: the staged host copy, or for a device array (already
            a copy of its own) its move to the host.
        """
        if type(value) is not np.ndarray:
            if not is_device_array(value):
                return functools.partial(to_host, value)
            # The device copy was queued on this thread's stream: the writer thread (whose current
            # stream is another) waits for this event before it reads the copy.
            cupy = array_module(value)
            with device_context(value):
                event = cupy.cuda.Event(disable_timing=True)
                event.record(cupy.cuda.get_current_stream())
            return functools.partial(_device_to_host, value, event)
        buf = self._staging.get(key)
        if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
            buf = np.empty(value.shape, value.dtype)
            self._staging[key] = buf
        self._staged.add(key)
        if value.dtype in SUPPORTED_DTYPES and value.nbytes >= _PARALLEL_COPY_BYTES and value.flags.c_contiguous:
            backend_for(buf).broadcast(value, [buf])  # the multi-threaded copy
        else:
            np.copyto(buf, value)
        return functools.partial(_identity, buf)

    def stage_variable(self, key: str, var: Any) -> Callable[[], Any]:
        """Captures a variable's value (``var``: a plain variable or one component) for the background write.

        Where the variable's updates can go out of place (a host variable of the native backend:
        :meth:`cudist._dataplane.storage.Storage.capture`), the capture is its copy-on-write
        snapshot: no copy now, and the next update writes recycled memory instead of this. Otherwise
        a copy, as :meth:`stage`. Call only after :meth:`sync`.

        Returns:
            The ``get`` of the tensor's spec.
        """
        capture = getattr(var.storage, "capture", None)  # a Storage (not a distributed variable's group)
        snap = capture() if capture is not None else None
        if snap is None:
            return self.stage(key, var.read_value())
        self._staging.pop(key, None)  # a copy no longer needed (it was staged by an earlier save)
        return functools.partial(_identity, snap)

    def release_unstaged(self) -> None:
        """Frees the buffers of tensors the last capture did not use (variables no longer tracked)."""
        for key in [k for k in self._staging if k not in self._staged]:
            del self._staging[key]
        self._staged = set()

    @property
    def pending(self) -> bool:
        """Whether a write is still running."""
        t = self._thread
        return t is not None and t.is_alive()

    def submit(self, job: Callable[[], None], what: str) -> None:
        """Waits for the previous write (raising its error), then starts ``job`` in a background thread.

        Args:
            job: the write (and what follows its commit: state files, callbacks).
            what: names the write in the thread's name and in the exit log.
        """
        self.sync()
        nice = _settings.checkpoint_writer_nice()  # read here: a bad value is the save's error, not the thread's
        thread = threading.Thread(
            target=self._run, args=(job, nice), name=f"cudist-checkpoint-write {what}", daemon=False
        )
        with self._lock:
            self._thread = thread
        _WRITERS.add(self)
        thread.start()

    def _run(self, job: Callable[[], None], nice: int) -> None:
        try:
            lower_thread_priority(nice)
            job()
        except BaseException as e:  # kept for the next save or sync() to raise in the caller's thread
            with self._lock:
                self._error = e

    def sync(self) -> None:
        """Waits for the pending write; raises its error if it failed (once)."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            if thread is not None and self._thread is thread:
                self._thread = None
            error, self._error = self._error, None
        if error is not None:
            raise error


@atexit.register
def _report_unobserved_errors() -> None:
    # Non-daemon writer threads have been joined by the time atexit runs (threading's shutdown comes
    # first): a write that failed after the program's last sync() is reported rather than lost.
    for writer in list(_WRITERS):
        error = writer._error
        if error is not None:
            _log.error("an asynchronous checkpoint write failed: %r", error)
