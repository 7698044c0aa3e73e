"""A variable's storage object (cudist._dataplane.storage, ``variable.storage``): copies, sharing,
copy-on-write, as the optimizer and checkpoints use it."""

from __future__ import annotations

import numpy as np

import cudist
from cudist._dataplane.storage import GroupStorage, Storage


def test_a_held_snapshot_moves_the_storage_on_detach():
    s = Storage(np.arange(4.0))
    a = s.array
    assert s.detach() is a  # nothing holds a snapshot: written in place
    snap = s.snapshot()
    assert not snap.flags.writeable and np.shares_memory(snap, a)
    assert s.snapshot_held()
    moved = s.detach()
    assert moved is not a and s.array is moved  # copy-on-write: the snapshot keeps the old memory
    moved[:] = -1
    np.testing.assert_array_equal(snap, np.arange(4.0))
    del snap
    assert not s.snapshot_held()


def test_mirrored_copies_share_one_host_array_until_split():
    shared = np.zeros(3)
    copies = [Storage(shared) for _ in range(3)]
    group = GroupStorage(copies, mirrored=True)
    assert group.buffers() == (shared,)  # one write reaches every copy
    assert all(c.shares() for c in copies)
    group.split()
    bufs = group.buffers()
    assert len(bufs) == 3 and len({id(b) for b in bufs}) == 3
    assert not any(c.shares() for c in copies)
    assert group.primary is copies[0].array and group.arrays() == bufs


def test_a_held_snapshot_moves_every_copy_sharing_the_array():
    shared = np.zeros(2)
    copies = [Storage(shared) for _ in range(2)]
    group = GroupStorage(copies, mirrored=True)
    snap = copies[1].snapshot()
    (buf,) = group.buffers()  # still one array for both copies, but fresh memory
    assert buf is not shared and all(c.array is buf for c in copies)
    del snap


def test_sync_on_read_copies_are_written_one_by_one():
    shared = np.zeros(2)
    group = GroupStorage([Storage(shared), Storage(shared)], mirrored=False)
    a, b = group.buffers()
    assert a is not b  # components that differ by design never share


def test_variables_expose_their_storage():
    v = cudist.Variable([1.0, 2.0])
    assert isinstance(v.storage, Storage) and v.storage.kernel() is not None
    strategy = cudist.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        m = cudist.Variable([1.0, 2.0])
    assert isinstance(m.storage, GroupStorage)
    assert m.storage.copies == tuple(c.storage for c in m.values)
    m.assign([3.0, 4.0])
    np.testing.assert_array_equal(m.storage.primary, [3.0, 4.0])
