"""``cudist.train``: checkpoints (``tf.train.Checkpoint``, ``CheckpointManager``, ``latest_checkpoint``) and
``ClusterSpec`` (``tf.train.ClusterSpec``; also ``cudist.cluster_resolver.ClusterSpec``).

::

    ckpt = cudist.train.Checkpoint(model=model, optimizer=optimizer, iterator=iterator)
    manager = cudist.train.CheckpointManager(ckpt, "/tmp/run", max_to_keep=3)
    ckpt.restore(manager.latest_checkpoint)      # None the first time: nothing restored
    ...
    manager.save()                               # /tmp/run/ckpt-1, ckpt-2, ...

What a checkpoint tracks and how a restore under another strategy or replica count assigns the
values: :mod:`cudist.train._checkpoint`. The on-disk format:

* ``<prefix>.index.json``: JSON, ``{"format": "cudist-checkpoint", "version": 2, "tensors":
  <tensors file name>, "save_counter": <int or null>, "objects": {<path>: <record>}, "crc32": <the
  CRC-32 of the rest>}``. A record's
  ``kind`` is ``"variable"`` (``tensor``: its key in the tensors file; ``dtype``, ``shape``,
  ``variable_class``, ``name``, ``trainable``, ``synchronization``, ``aggregation``, ``replicas``,
  and for sync-on-read variables ``per_replica``: the keys of the components), ``"slot"`` (the same,
  plus ``optimizer``, ``variable``: the paths it links, and ``slot``: its name), ``"optimizer"``
  (``optimizer_class``, ``hyperparameters``, ``iterations``: the path of its counter, ``slots``:
  {variable path: {slot name: slot path}}) or ``"iterator"`` (``position``: steps consumed).
* ``<prefix>.data-<8 hex>.safetensors``: the tensors, keyed by path
  (``safetensors.numpy.load_file`` reads it), each one's CRC-32 in its ``__metadata__``
  (``"crc32:<path>"``). complex128, which safetensors lacks, is stored as float64 pairs (a trailing
  dimension of 2).
* ``<directory>/checkpoint``: the state file :func:`latest_checkpoint` reads (JSON with the fields
  of TF's ``checkpoint`` file).

The index is committed last, by an atomic rename after the tensors are fsynced: a crash or SIGKILL
during a save leaves the previous checkpoints intact and ``latest_checkpoint`` naming one of them.
Saving streams one tensor at a time (host variables are written from their storage, without a
copy). Restoring checks everything (checksums included) before it assigns anything; a damaged
checkpoint is :class:`cudist.errors.DataLossError` naming the file and the problem. Saves can be asynchronous
(``CheckpointOptions(enable_async=True)``: :mod:`cudist.train._async`); surviving preemption:
:mod:`cudist.train.experimental`. Integrity,
locking and cleanup: :mod:`cudist.train._format`. Why safetensors rather than ``.npz`` (measured):
:mod:`cudist.train._format`.
"""

from __future__ import annotations

from cudist.cluster_resolver import ClusterSpec
from cudist.train import experimental
from cudist.train._async import CheckpointOptions
from cudist.train._checkpoint import Checkpoint, CheckpointLoadStatus, InitializationOnlyStatus
from cudist.train._manager import CheckpointManager, latest_checkpoint

__all__ = [
    "Checkpoint",
    "ClusterSpec",
    "CheckpointManager",
    "CheckpointLoadStatus",
    "CheckpointOptions",
    "InitializationOnlyStatus",
    "latest_checkpoint",
]
