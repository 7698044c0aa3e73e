"""A variable's storage: its copies, copy-on-write snapshots, shared host storage, kernel backend.

Every :class:`cudist.Variable` holds one storage object, ``variable.storage`` (internal to the
package, stable for its modules: the optimizer's update pass, checkpoints, the strategies):

* a plain (or aggregating) variable, and each component of a distributed one: a :class:`Storage`,
  one live array (NumPy on CPU devices, CuPy on a GPU);
* a distributed variable: a :class:`GroupStorage` over its components' storages, in component
  order. The components of a mirrored variable on CPU devices start out sharing ONE host array
  (they would hold the same bytes in the same memory), so an update of every copy writes it once;
  a write of one component alone moves that component to memory of its own first.

Reads hand out copy-on-write snapshots (:meth:`Storage.snapshot`): on the host a read-only view
that shares the storage until the next write while the snapshot (or an array derived from it) is
still referenced; that write first moves the storage to fresh memory, so the snapshot keeps the
value it had, as a TF tensor read from a variable does. Every in-place writer asks for its arrays
through :meth:`Storage.detach` / ``buffers()``, which do that move.

The variable semantics (assign, aggregation, synchronization, which component a replica reads) stay
in :mod:`cudist._variables`; this module knows arrays only.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from cudist._arrays import snapshot as _device_snapshot
from cudist._kernels import backend_for

if TYPE_CHECKING:
    from cudist._arrays import Array
    from cudist._kernels import KernelBackend

__all__ = ["GroupStorage", "Storage", "kernel_backend"]

#: The "not chosen yet" value of a storage's cached kernel backend (None is a valid choice: no
#: backend handles the dtype).
_UNSET: Any = object()


def kernel_backend(arr: Any) -> KernelBackend | None:
    """The kernel backend for buffers like ``arr``, or None when no backend handles its dtype."""
    backend = backend_for(arr)
    return backend if arr.dtype in backend.dtypes else None


class Storage:
    """One array of a variable (a plain variable's, or one component's of a distributed variable).

    Attributes:
        array: the live array (no copy): callers must not keep it across a write, nor write it
            without :meth:`detach` (a snapshot or another component may share it).
    """

    __slots__ = ("array", "_snap", "_group", "_backend", "__weakref__")

    def __init__(self, array: Array) -> None:
        self.array = array
        #: The read-only view of the host array that :meth:`snapshot`'s snapshots are views of.
        self._snap: npt.NDArray[Any] | None = None
        #: The group of a distributed variable's component (weakly: the variable owns the group).
        self._group: weakref.ref[GroupStorage] | None = None
        self._backend: KernelBackend | None = _UNSET

    # ---- the interface shared with GroupStorage
    @property
    def primary(self) -> Array:
        """The array shape, dtype and device questions are answered from (the only one here)."""
        return self.array

    def kernel(self) -> KernelBackend | None:
        """The kernel backend of this storage's arrays (None if none handles the dtype), chosen once."""
        backend = self._backend
        if backend is _UNSET:
            backend = self._backend = kernel_backend(self.array)
        return backend

    def buffers(self) -> tuple[Array, ...]:
        """The arrays to write in place (one): detached first, see :meth:`detach`."""
        return (self.detach(),)

    def split(self) -> None:
        """Gives every copy storage of its own (one array has it already)."""

    # ---- snapshots and copy-on-write
    def snapshot(self) -> Array:
        """A snapshot of the array: a shared read-only view on the host, a copy on a GPU.

        Why a view over a memoryview rather than ``a.view()``: NumPy collapses the base of every
        view derived from ``a.view()`` to ``a`` itself, but stops at an array whose base is not an
        array, so every array derived from this snapshot (``s.T``, ``s[1:]``...) keeps the snapshot
        object alive and :meth:`snapshot_held` sees them all in its reference count.
        """
        a = self.array
        if type(a) is not np.ndarray:
            return _device_snapshot(a)
        s = self._snap
        if s is None or s.base.obj is not a:  # type: ignore[union-attr]  # the memoryview's exporter
            s = np.asarray(a.data)  # a.data: a memoryview of the storage
            s.flags.writeable = False
            self._snap = s
        # A new object per read (its base is ``s``), as every TF read is a new tensor: ``run`` keeps
        # the same object returned by every replica unwrapped, distinct ones become PerReplica.
        return s.view()

    def snapshot_held(self) -> bool:
        """Whether a snapshot of this array (or an array derived from one) is referenced outside."""
        snap = self._snap
        # References: the slot, ``snap`` and getrefcount's argument; more are snapshot holders.
        return snap is not None and sys.getrefcount(snap) > 3

    def shares(self) -> bool:
        """Whether another copy of this storage's group uses the same array."""
        ref = self._group
        group = ref() if ref is not None else None
        if group is None:
            return False
        a = self.array
        return any(c is not self and c.array is a for c in group.copies)

    def detach(self) -> Array:
        """The array, ready for a write of this copy alone: moved to fresh memory first if a
        snapshot of it is still referenced (copy-on-write) or another copy shares it (host copies
        of a mirrored variable). Every single-copy in-place writer calls this."""
        if self.snapshot_held() or self.shares():
            self.array = self.array.copy()
            self._snap = None
        return self.array

    def replace(self, array: Array) -> None:
        """Makes ``array`` the storage (a write that reallocates: a new shape allowed by ``shape=``)."""
        self.array = array
        self._snap = None

    def clone(self) -> Storage:
        """An independent storage holding a copy of the value (``copy.deepcopy`` of a variable)."""
        return Storage(_device_snapshot(self.array))


class GroupStorage:
    """The storages of a distributed variable's components, in component order.

    Args:
        copies: the components' storages (each joins this group, weakly: the variable owns it).
        mirrored: whether the copies hold one value (a MirroredVariable): :meth:`buffers` then
            returns the DISTINCT arrays, one per memory the copies share; otherwise (sync-on-read
            components, which differ by design) one per copy.
    """

    __slots__ = ("copies", "mirrored", "_backend", "__weakref__")

    def __init__(self, copies: Sequence[Storage], *, mirrored: bool) -> None:
        self.copies: tuple[Storage, ...] = tuple(copies)
        self.mirrored = mirrored
        self._backend: KernelBackend | None = _UNSET
        ref = weakref.ref(self)
        for c in self.copies:
            c._group = ref

    @property
    def primary(self) -> Array:
        """Copy 0's array (the one shape, dtype and device questions are answered from)."""
        return self.copies[0].array

    def arrays(self) -> tuple[Array, ...]:
        """Every copy's live array, in component order (to read; writers use :meth:`buffers`)."""
        return tuple(c.array for c in self.copies)

    def host(self) -> bool:
        """Whether every copy is a NumPy array (CPU devices)."""
        return all(type(c.array) is np.ndarray for c in self.copies)

    def kernel(self) -> KernelBackend | None:
        """The kernel backend of copy 0's array (None if none handles the dtype), chosen once."""
        backend = self._backend
        if backend is _UNSET:
            backend = self._backend = kernel_backend(self.primary)
        return backend

    def buffers(self) -> tuple[Array, ...]:
        """The arrays to write in place, in component order.

        Mirrored: the distinct arrays. Copies on CPU devices start out sharing one host array, so an
        update of every copy writes it once; an array with a snapshot still held moves to fresh
        memory for every copy sharing it. Otherwise: one detached array per copy.
        """
        copies = self.copies
        if not self.mirrored:
            return tuple(c.detach() for c in copies)
        a0 = copies[0].array
        for c in copies:  # the common case first: one shared array, no snapshot held (or taken)
            if c.array is not a0 or (c._snap is not None and c.snapshot_held()):
                break
        else:
            return (a0,)
        out: list[Array] = []
        for i, c in enumerate(copies):
            a = c.array
            if any(a is o for o in out):
                continue
            sharing = [c] + [o for o in copies[i + 1 :] if o.array is a]
            if any(o.snapshot_held() for o in sharing):
                a = a.copy()
                for o in sharing:
                    o.array = a
                    o._snap = None
            out.append(a)
        return tuple(out)

    def split(self) -> None:
        """Gives every copy an array of its own (a no-op unless some share one)."""
        for c in self.copies:
            c.detach()

    def snapshots(self) -> tuple[Array, ...]:
        """A snapshot per copy (:meth:`Storage.snapshot`), as TF's update results of a mirrored
        variable are: a copy-on-write view of each host copy, a copy on each device copy's GPU."""
        return tuple(c.snapshot() for c in self.copies)
