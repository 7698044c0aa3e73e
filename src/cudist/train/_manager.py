"""``CheckpointManager`` and ``latest_checkpoint`` (``tf.train.CheckpointManager``, ``tf.train.latest_checkpoint``).

The manager numbers checkpoints ``<directory>/<checkpoint_name>-<n>``, keeps the ``max_to_keep``
newest (older ones are deleted, index first, unless ``keep_checkpoint_every_n_hours`` preserves
them), and records its state in ``<directory>/checkpoint`` after each save, atomically and only
once the new checkpoint is committed: a crash at any point leaves ``latest_checkpoint`` naming a
complete checkpoint. A new manager on the same directory picks the state up (TF's rules, timestamps
included).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from cudist.train import _format
from cudist.train import _async
from cudist.train._async import CheckpointOptions
from cudist.train._checkpoint import Checkpoint, require_cross_replica, write_checkpoint

__all__ = ["CheckpointManager", "latest_checkpoint"]

_log = logging.getLogger("cudist")


def latest_checkpoint(checkpoint_dir: str | os.PathLike[str], latest_filename: str | None = None) -> str | None:
    """The prefix of the newest checkpoint recorded in ``checkpoint_dir``, or None.

    Reads the directory's state file (written by :meth:`Checkpoint.save` and by
    :class:`CheckpointManager`), and returns its latest checkpoint if that checkpoint exists. A state
    file that cannot be read, or that names a file outside ``checkpoint_dir``, is logged and ignored
    (TF logs and ignores an unparsable one too).
    """
    directory = os.fspath(checkpoint_dir)
    state = _format.read_state(directory, latest_filename or _format.STATE_FILE)
    if state is None or state["model_checkpoint_path"] is None:
        return None
    path = str(state["model_checkpoint_path"])
    if _format.exists(path):
        return path
    _log.error("Couldn't match files for checkpoint %s", path)
    return None


class CheckpointManager:
    """Manages the checkpoints of one :class:`Checkpoint` in a directory (``tf.train.CheckpointManager``).

    Args:
        checkpoint: the :class:`Checkpoint` to save.
        directory: where checkpoints and the ``checkpoint`` state file go (created if missing).
        max_to_keep: how many checkpoints to keep (the newest); None keeps all.
        keep_checkpoint_every_n_hours: when a checkpoint leaves the kept set, it is preserved anyway
            if it is at least this many hours newer than the last preserved one.
        checkpoint_name: the checkpoints' file name before ``-<number>``. Managers of different
            names share a directory: each lists, restores and deletes only checkpoints of its name.
        step_counter: a variable counting steps; with ``checkpoint_interval``, :meth:`save` only saves
            when ``step_counter`` has advanced by ``checkpoint_interval`` since the last save.
        checkpoint_interval: the number of steps between saves (with ``step_counter``).
        init_fn: called by :meth:`restore_or_initialize` when there is no checkpoint.
        last_checkpoint_step: the step of the last save, for ``checkpoint_interval``.

    Raises:
        ValueError: ``max_to_keep`` not a positive integer or None; ``checkpoint_interval`` without
            ``step_counter``; a ``checkpoint_name`` that is not a plain file name.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str | os.PathLike[str],
        max_to_keep: int | None = 5,
        keep_checkpoint_every_n_hours: float | None = None,
        checkpoint_name: str = "ckpt",
        step_counter: Any = None,
        checkpoint_interval: int | None = None,
        init_fn: Callable[[], object] | None = None,
        last_checkpoint_step: int | None = None,
    ) -> None:
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or int(max_to_keep) != max_to_keep or max_to_keep <= 0):
            raise ValueError(f"Expected a positive integer or `None` for `max_to_keep`, got {max_to_keep}.")
        if checkpoint_interval is not None and step_counter is None:
            raise ValueError("`step_counter` should be passed if `checkpoint_interval` is not None.")
        if not _format.is_bare_name(checkpoint_name):
            raise ValueError(f"`checkpoint_name` must be a file name (no directories), got {checkpoint_name!r}")
        self._checkpoint = checkpoint
        self._max_to_keep = max_to_keep
        self._keep_checkpoint_every_n_hours = keep_checkpoint_every_n_hours
        self._directory = os.fspath(directory)
        self._name = checkpoint_name
        self._checkpoint_prefix = os.path.join(self._directory, checkpoint_name)
        self._init_fn = init_fn
        self._step_counter = step_counter
        self._checkpoint_interval = checkpoint_interval
        self._last_checkpoint_step = last_checkpoint_step
        now = time.time()
        self._maybe_delete: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._latest_checkpoint: str | None = None
        self._last_preserved_timestamp = now - 1.0
        state = _format.read_state(self._directory)
        if state is not None:
            # Only checkpoints of this manager's name: another manager's are not ours to list or delete.
            mine = _format.numbered(checkpoint_name)
            entries = [(p, t) for p, t in state["entries"] if mine.fullmatch(os.path.basename(p))]
            latest = state["model_checkpoint_path"]
            if latest is not None and mine.fullmatch(os.path.basename(latest)):
                self._latest_checkpoint = latest
            elif entries:
                self._latest_checkpoint = entries[-1][0]
            if state["last_preserved_timestamp"] is not None:
                self._last_preserved_timestamp = float(state["last_preserved_timestamp"])
            if now < self._last_preserved_timestamp:
                _log.warning(
                    "time.time() returned a value %f seconds behind the last preserved checkpoint timestamp.",
                    self._last_preserved_timestamp - now,
                )
                self._last_preserved_timestamp = now
            for path, stamp in entries:
                stamp = min(self._last_preserved_timestamp if stamp is None else stamp, now)
                if stamp > self._last_preserved_timestamp:
                    self._maybe_delete[path] = stamp

    # -- properties
    @property
    def directory(self) -> str:
        return self._directory

    @property
    def checkpoint(self) -> Checkpoint:
        """The managed :class:`Checkpoint`."""
        return self._checkpoint

    @property
    def checkpoint_interval(self) -> int | None:
        return self._checkpoint_interval

    @property
    def latest_checkpoint(self) -> str | None:
        """The prefix of the newest checkpoint in ``directory`` (None if there is none)."""
        return self._latest_checkpoint

    @property
    def checkpoints(self) -> list[str]:
        """The managed checkpoints, oldest first (those kept by ``keep_checkpoint_every_n_hours`` are not listed)."""
        return list(self._maybe_delete)

    # -- saving
    def _sweep(self, delete: bool = True) -> None:
        if not self._max_to_keep:
            return
        while len(self._maybe_delete) > self._max_to_keep:
            path, stamp = self._maybe_delete.popitem(last=False)
            hours = self._keep_checkpoint_every_n_hours
            if hours and stamp - hours * 3600.0 >= self._last_preserved_timestamp:
                self._last_preserved_timestamp = stamp
                continue
            if delete:
                _format.remove_checkpoint(path)

    def _record_state(self) -> None:
        assert self._latest_checkpoint is not None
        _format.write_state(
            self._directory, self._latest_checkpoint, self._name, self._maybe_delete.items(), self._last_preserved_timestamp
        )

    def save(
        self, checkpoint_number: Any = None, check_interval: bool = True, options: CheckpointOptions | None = None
    ) -> str | None:
        """Saves a new checkpoint, records it as the latest, and deletes the ones no longer kept.

        Args:
            checkpoint_number: the number to give it (an int or an integer variable); by default the
                checkpoint's ``save_counter``, which is incremented either way.
            check_interval: with ``checkpoint_interval``, save only if the step counter advanced by it.
            options: a :class:`cudist.train.CheckpointOptions`. With ``enable_async=True`` the call
                returns once the state is captured; the write, the state file and the deletion of
                checkpoints no longer kept follow in the background, in that order (so the state
                file names the new checkpoint only once it is committed); as in TF,
                :attr:`latest_checkpoint` names it once it is written. :meth:`sync` waits for it.

        Returns:
            The new checkpoint's prefix, or None when ``checkpoint_interval`` skipped the save.

        Raises:
            Exception: the error of the previous asynchronous write, if it failed.
        """
        require_cross_replica("CheckpointManager.save")
        options = _async.check_options(options)
        self.sync()  # one write at a time (this manager's bookkeeping included); a failed one raises here
        if self._checkpoint_interval is not None:
            step = int(self._step_counter)
            if self._last_checkpoint_step is not None:
                if step == self._last_checkpoint_step:
                    return None
                if check_interval and step < self._last_checkpoint_step + self._checkpoint_interval:
                    return None
            self._last_checkpoint_step = step
        counter = self._checkpoint.save_counter
        counter.assign_add(1, read_value=False)
        number = int(counter) if checkpoint_number is None else int(checkpoint_number)
        path = f"{self._checkpoint_prefix}-{number}"

        def note() -> None:  # the new checkpoint in memory, once written (TF's write_done_callback)
            self._maybe_delete.pop(path, None)
            self._maybe_delete[path] = time.time()
            self._latest_checkpoint = path

        def committed() -> None:
            note()
            self._record_state()
            self._sweep()
            self._record_state()
            _format.remove_orphans(self._directory, self._name)  # debris of this name's crashed or failed saves

        if not write_checkpoint(self._checkpoint, path, options, committed):
            note()  # not the chief: the same bookkeeping in memory, no files touched
            self._sweep(delete=False)
        return path

    def restore_or_initialize(self) -> str | None:
        """Restores the latest checkpoint if there is one (returns its path), else calls ``init_fn``
        (returns None)."""
        if self._latest_checkpoint is not None:
            self._checkpoint.restore(self._latest_checkpoint)
            if self._checkpoint_interval is not None:
                self._last_checkpoint_step = int(self._step_counter)
            return self._latest_checkpoint
        if self._init_fn is not None:
            self._init_fn()
        return None

    def sync(self) -> None:
        """Waits for the pending asynchronous save of the managed checkpoint, if any (see :meth:`save`).

        Raises:
            Exception: the error that save failed with (raised once).
        """
        self._checkpoint.sync()

    def __repr__(self) -> str:
        return f"<cudist.train.CheckpointManager {self._checkpoint_prefix!r} latest={self._latest_checkpoint!r}>"
