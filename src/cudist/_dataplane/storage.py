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

The optimizers' update pass instead asks for :meth:`Storage.targets`: with a snapshot held and a
kernel backend whose update kernels can read one array and write another (the native backend's
``trusted.out_of_place``), the update reads the held array and writes the new value into other
memory, which :meth:`Storage.commit` then makes the storage: no copy. A storage captured by a
long-lived reader (:meth:`Storage.capture`: an asynchronous checkpoint's background write) keeps
the array it moved away from and writes into it again at the next such move, once the reader has
let go of it: its pages are already mapped, where fresh memory costs a page fault per 4 KiB
(~450 ms for 256 MiB on the 2-core build machine, more than a synchronous save of it).

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
from cudist._kernels import backend_for, is_bfloat16, numpy_backend

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
    if arr.dtype in backend.dtypes:
        return backend
    if is_bfloat16(arr.dtype):
        if backend.bfloat16_updates:
            return backend  # the GPU's kernels: float32 arithmetic, one rounding per stored value
        if type(arr) is np.ndarray:
            # bfloat16 variables on the CPU: the one fallback point. Only the NumPy reference updates
            # them (the same arithmetic), so every CPU backend gives the same bits.
            return numpy_backend()
    return None


def _views_of(s: npt.NDArray[Any], a: npt.NDArray[Any]) -> bool:
    """Whether the snapshot base ``s`` (an array over a memoryview) views the memory of ``a``."""
    exporter = s.base.obj  # type: ignore[union-attr]
    if exporter is a:
        return True
    # A dtype exported as integers (see Storage.snapshot): the exporter is a view of ``a`` made for
    # it. It keeps its memory alive, so an array at the same address and layout is that memory.
    return (s.dtype != a.dtype and exporter.shape == a.shape and exporter.strides == a.strides
            and exporter.__array_interface__["data"][0] == a.__array_interface__["data"][0])


class Storage:
    """One array of a variable (a plain variable's, or one component's of a distributed variable).

    Attributes:
        array: the live array (no copy): callers must not keep it across a write, nor write it
            without :meth:`detach` (a snapshot or another component may share it).
    """

    __slots__ = ("array", "_snap", "_group", "_backend", "_spare", "_retired", "_retired_snap", "_recycle", "__weakref__")

    def __init__(self, array: Array) -> None:
        self.array = array
        #: The read-only view of the host array that :meth:`snapshot`'s snapshots are views of.
        self._snap: npt.NDArray[Any] | None = None
        #: The group of a distributed variable's component (weakly: the variable owns the group).
        self._group: weakref.ref[GroupStorage] | None = None
        self._backend: KernelBackend | None = _UNSET
        #: The buffer :meth:`targets` hands out for an out-of-place write not yet committed.
        self._spare: npt.NDArray[Any] | None = None
        #: The array the last committed out-of-place write moved away from, with its snapshot view
        #: (whose reference count says whether a reader still holds it): reused once let go of.
        self._retired: npt.NDArray[Any] | None = None
        self._retired_snap: npt.NDArray[Any] | None = None
        #: Whether to keep the retired array (set by :meth:`capture`).
        self._recycle = False

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
        if s is None or (s.base.obj is not a and not _views_of(s, a)):  # type: ignore[union-attr]
            try:
                m = a.data  # a memoryview of the storage
            except ValueError:
                # A dtype the buffer protocol cannot name (ml_dtypes' bfloat16): the same bytes as
                # unsigned integers of its size; reads view them back as the variable's dtype.
                m = a.view(f"u{a.dtype.itemsize}").data
            s = np.asarray(m)
            s.flags.writeable = False
            self._snap = s
        # A new object per read (its base is ``s``), as every TF read is a new tensor: ``run`` keeps
        # the same object returned by every replica unwrapped, distinct ones become PerReplica.
        return s.view(a.dtype)

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

    # ---- out-of-place writes (the update pass) and recycled buffers
    def out_of_place(self) -> bool:
        """Whether a write of this storage can go out of place (:meth:`targets`): a host array of
        its own (not shared with another copy) whose kernel backend has out-of-place updates."""
        if type(self.array) is not np.ndarray or self._group is not None:
            return False
        backend = self.kernel()
        return backend is not None and bool(backend.trusted.out_of_place)

    def capture(self) -> Array | None:
        """A snapshot (:meth:`snapshot`) for a reader that holds it while the variable is updated (an
        asynchronous checkpoint's background write), or None where writes cannot go out of place
        (see :meth:`out_of_place`: the reader should copy the value instead).

        From then on the storage recycles memory: the array an out-of-place write moves away from is
        kept, and the next such write goes into it once its readers have let go of it (at most one
        array is kept: memory stays bounded however many captures are made).
        """
        if not self.out_of_place():
            return None
        self._recycle = True
        return self.snapshot()

    def targets(self) -> tuple[tuple[Array, ...], Array]:
        """(the arrays an update writes: one, the array it reads the current value from).

        In place (the same array) unless a snapshot is held and the write can go out of place
        (:meth:`out_of_place`): then the value is read from the held array and written into another
        one -- a recycled buffer (:meth:`capture`) or fresh memory -- which :meth:`commit` makes the
        storage once written. Nothing changes before :meth:`commit`: asking again gives the same
        arrays. Otherwise the write is in place, after :meth:`detach`.
        """
        a = self.array
        if self._snap is None or not self.snapshot_held() or not self.out_of_place():
            a = self.detach()
            return (a,), a
        return (self._write_buffer(a),), a

    def _write_buffer(self, a: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """The buffer an out-of-place write of ``a``'s new value goes into (the same until committed)."""
        s = self._spare
        if s is not None and s.shape == a.shape and s.dtype == a.dtype:
            return s
        s = self._reusable_retired(a)
        if s is None:
            s = np.empty(a.shape, a.dtype)
        self._retired = self._retired_snap = None
        self._spare = s
        return s

    def _reusable_retired(self, like: npt.NDArray[Any]) -> npt.NDArray[Any] | None:
        """The retired array, if it fits ``like`` and nobody else holds it (nor a view of its snapshot)."""
        r = self._retired
        snap = self._retired_snap
        if r is None or r.shape != like.shape or r.dtype != like.dtype:
            return None
        # The snapshot view's references: the slot, ``snap``, getrefcount's argument; the array's:
        # the slot, ``r``, getrefcount's argument and the view's memoryview. More: a reader (the
        # background write) or an export (DLPack) still holds it.
        if snap is not None and sys.getrefcount(snap) > 3:
            return None
        if sys.getrefcount(r) > 3 + (snap is not None):
            return None
        return r

    def commit(self, array: Array) -> None:
        """Makes ``array`` (the write buffer :meth:`targets` handed out, now written) the storage."""
        old = self.array
        if array is old:
            return
        if self._recycle:
            self._retired, self._retired_snap = old, self._snap
        self.array = array
        self._snap = None
        if self._spare is array:
            self._spare = None

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

    def targets(self) -> tuple[tuple[Array, ...], Array]:
        """(the arrays to write, :meth:`buffers`; the array an update reads: the first of them).

        In place: a distributed variable's copies are not written out of place (see
        :meth:`Storage.targets`)."""
        bufs = self.buffers()
        return bufs, bufs[0]

    def commit(self, array: Array) -> None:
        """Nothing to do: :meth:`targets` writes in place (the interface shared with :meth:`Storage.commit`)."""

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
