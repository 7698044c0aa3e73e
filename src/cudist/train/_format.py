"""The on-disk format of a checkpoint: a safetensors tensors file and a JSON index, written atomically.

A checkpoint with prefix ``dir/ckpt-3`` is two files:

* ``dir/ckpt-3.data-<8 hex digits>.safetensors``: every tensor, in the `safetensors
  <https://github.com/huggingface/safetensors>`_ layout (an 8-byte little-endian header length, a
  JSON header giving each tensor's dtype, shape and byte range, then the raw little-endian bytes).
  ``safetensors.numpy.load_file`` reads it. The random suffix is new on every write, so writing a
  checkpoint over an existing one never touches the files the existing index refers to.
* ``dir/ckpt-3.index.json``: the object graph (see :mod:`cudist.train._checkpoint`), naming its
  tensors file. Written last, by an atomic rename: it is the commit point. A checkpoint exists iff
  its index does.

Integrity (format version 2). Each tensor's CRC-32 is in the safetensors ``__metadata__``
(``"crc32:<key>": "<8 hex digits>"``; metadata is a str -> str map, so the ``safetensors`` package
still reads the file) and is verified on restore; the index carries the CRC-32 of its own content
(``"crc32"``: of its canonical JSON, sorted keys, without that field), and every tensor it names must
be in the header with its dtype and shape, the header's byte ranges tiling the data exactly. CRC-32
is zlib's (the polynomial of zip and PNG), not TF's CRC32C, so that every reader can compute it:
``zlib.crc32`` (~4 GB/s here, which doubled a restore from the page cache) where ``cudist._core``
is not built, and its ``crc32`` (the same values by PCLMULQDQ folding, ~14 GB/s) where it is.
Version 1 files (no checksums) still restore.
Anything wrong with the files is :class:`cudist.errors.DataLossError` naming the file and the
problem; headers, indexes and state files over :data:`MAX_JSON_BYTES` are refused before they are
read (safetensors' own header limit), and only regular files are opened (a FIFO would block).

Why safetensors and not ``.npz`` (measured on this 2-core machine, a 200 MB model of 50 float32
tensors, median of 5 runs, each in a fresh process, fsync included): writing it tensor by tensor
took 0.14 s against 0.23 s for an ``.npz`` streamed entry by entry through ``zipfile`` (0.26 s for
``np.savez``; the zip layer CRC-32s every byte), and reading it back into existing arrays took
0.03 s (``readinto`` straight into the destination, 4 MB of extra memory) against 0.11 s for
``numpy.load`` of the ``.npz`` (and 0.06 s through ``safetensors.safe_open``, 0.13 s through
``safetensors.numpy.load_file``, which holds every tensor at once). The format is simple enough to
write and read here without the ``safetensors`` package, which also lets the writer stream: its
``save_file`` wants every tensor at once, while a checkpoint computes some tensors (a sync-on-read
variable's aggregate, a GPU variable's host copy) and must hold only one at a time.

Writing (:func:`write_checkpoint`): the tensors go from their arrays to the file without a Python
loop per chunk. With ``CUDIST_CHECKPOINT_DIRECT_IO=on`` (off by default: see the variable), a
tensors file with at least 8 MiB of data is written with ``O_DIRECT`` where the file system allows
it (:class:`_DirectStream`): each piece is copied into a 1 MiB aligned bounce
buffer, summed there while in cache and written by DMA, so the kernel does not copy it into the page
cache; the header is then padded with spaces so that the data starts at a multiple of 4096 bytes
(the only difference on disk; every safetensors reader skips them, cudist's own included). Smaller
files, other settings and file systems without ``O_DIRECT`` (tmpfs) go through the page cache, one
``cudist._core.write_crc32`` call per tensor (``os.write`` and ``zlib.crc32`` per MiB without the
extension). Either way the GIL is not taken back per chunk, which an asynchronous save's thread
would otherwise contend for with the training loop beside it.

Dtypes: bool, (u)int8/16/32/64, float16/32/64 and complex64 map to safetensors' own codes;
complex128, which safetensors lacks, is stored as F64 with a trailing dimension of 2 (real,
imaginary), the index keeping the true dtype.

Atomicity (a crash or SIGKILL at any point leaves every committed checkpoint readable): the tensors
go to a hidden temporary file in the same directory, which is fsynced and renamed to its final name
(then the directory is fsynced); the index is written the same way after it. A writer holds an
exclusive ``flock`` on each file it creates until its index is committed; cleaning up removes only
files nobody holds (a dead writer's locks are gone) and no index names, so two writers racing on one
prefix leave one complete checkpoint, and the debris of a crash (a ``.tmp`` file, a tensors file no
index names) is removed by the next write of the same prefix (a manager sweeps its whole name). A
save that fails after its tensors file is complete (no space for the index) removes that file.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import math
import os
import re
import secrets
import stat
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from cudist import _settings
from cudist.errors import DataLossError

try:
    import fcntl
except ImportError:  # Windows: no flock; cleaning up cannot tell a live writer's files from debris
    fcntl = None  # type: ignore[assignment]

_log = logging.getLogger("cudist")

#: What a checkpoint writes of one tensor: (key, dtype, shape, a function returning its host array).
TensorSpec = tuple[str, "np.dtype[Any]", tuple[int, ...], Callable[[], Any]]

#: NumPy dtype -> safetensors dtype code.
_CODES = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint16): "U16",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint32): "U32",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint64): "U64",
    np.dtype(np.int64): "I64",
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(np.complex64): "C64",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
# bfloat16 (ml_dtypes, optional) is not imported here; only its byte size matters to the header checks.
_DTYPES["BF16"] = np.dtype(np.uint16)
_COMPLEX128 = np.dtype(np.complex128)
#: The dtype names an index may record.
DTYPE_NAMES = frozenset([d.name for d in _CODES] + [_COMPLEX128.name, "bfloat16"])

INDEX_SUFFIX = ".index.json"
DATA_INFIX = ".data-"
DATA_SUFFIX = ".safetensors"
FORMAT = "cudist-checkpoint"
VERSION = 2  # 2: per-tensor CRC-32s in the header, the index's own CRC-32
READABLE_VERSIONS = (1, 2)
#: The largest safetensors header, index or state file read (safetensors' own header limit).
MAX_JSON_BYTES = 100_000_000
_CRC_PREFIX = "crc32:"
_CHUNK = 1 << 20  # I/O and checksum granularity of large tensors


def _np_dtype(dtype: npt.DTypeLike) -> np.dtype[Any]:
    """``np.dtype(dtype)``, the name "bfloat16" included (ml_dtypes registers it when imported)."""
    if dtype == "bfloat16":
        import ml_dtypes  # noqa: PLC0415 - optional: only bfloat16 checkpoints need it

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def _stored(dtype: npt.DTypeLike, shape: Sequence[int]) -> tuple[str, list[int]]:
    """The safetensors code and shape a tensor of ``dtype``/``shape`` is stored with."""
    dtype = _np_dtype(dtype)
    if dtype == _COMPLEX128:
        return "F64", [*shape, 2]
    if dtype.name == "bfloat16":
        return "BF16", list(shape)
    code = _CODES.get(dtype.newbyteorder("="))
    if code is None:
        raise TypeError(f"cannot checkpoint a tensor of dtype {dtype}: no safetensors dtype for it")
    return code, list(shape)


def _little(arr: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``arr`` C-contiguous and little-endian (itself when it already is)."""
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not _LITTLE):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr)


_LITTLE = np.little_endian


def _bytes_of(arr: npt.NDArray[Any]) -> memoryview:
    return memoryview(arr.reshape(-1).view(np.uint8).data)


def _data_loss(path: str, what: str) -> DataLossError:
    """The error for a damaged checkpoint file: the file, then what is wrong (cut at 1000 characters:
    a crafted file may hold megabytes where a name or a shape belongs)."""
    message = f"{path}: {what}"
    return DataLossError(message if len(message) <= 1000 else message[:997] + "...")


def _is_count(x: object) -> bool:
    """A JSON integer >= 0 (not a bool)."""
    return type(x) is int and x >= 0


# ------------------------------------------------------------------------------------- checksums
def _load_crc32() -> Callable[[Any, int], int]:
    """``cudist._core.crc32`` where it folds with PCLMULQDQ (~14 GB/s here), else ``zlib.crc32``
    (~4 GB/s): the same function, so either reads what the other wrote."""
    try:
        from cudist import _core  # noqa: PLC0415 - optional extension
    except ImportError:
        return zlib.crc32
    return _core.crc32 if getattr(_core, "crc32_accelerated", False) else zlib.crc32


_crc32 = _load_crc32()


def _load_write_crc32() -> Callable[[int, Any, int], int] | None:
    """``cudist._core.write_crc32`` where it is built and its CRC-32 folds with PCLMULQDQ, else None
    (a table-driven CRC-32 would be slower than ``zlib.crc32`` in the Python loop)."""
    try:
        from cudist import _core  # noqa: PLC0415 - optional extension
    except ImportError:
        return None
    if not getattr(_core, "crc32_accelerated", False):
        return None
    return getattr(_core, "write_crc32", None)


#: The native tensor writer (one call per tensor, without the GIL), or None: the Python loop below.
_write_crc32 = _load_write_crc32()


def _load_direct() -> tuple[Callable[..., tuple[int, int, int]], Callable[..., None]] | None:
    """``cudist._core``'s ``direct_append_crc32`` and ``direct_finish`` where the native writer is
    usable and the platform has ``O_DIRECT``, else None."""
    if _write_crc32 is None or not hasattr(os, "O_DIRECT"):
        return None
    from cudist import _core  # noqa: PLC0415 - optional extension

    append, finish = getattr(_core, "direct_append_crc32", None), getattr(_core, "direct_finish", None)
    return (append, finish) if append is not None and finish is not None else None


#: The O_DIRECT tensor writer (see :class:`_DirectStream`), or None: every write goes through the page cache.
_direct = _load_direct()
#: Tensors files with at least this many bytes of data are written with O_DIRECT where it works.
_DIRECT_MIN_BYTES = 8 << 20
_DIRECT_ALIGN = 4096  # O_DIRECT's alignment of file offsets, lengths and memory (the usual page and block size)
_BOUNCE_BYTES = 1 << 20  # the O_DIRECT write size: one write(2) per MiB, as the buffered writer


class _DirectStream:
    """The tensors' bytes written with ``O_DIRECT`` through a small aligned bounce buffer.

    Why: a buffered write copies every byte into the page cache in the kernel (~56 ms of CPU per 256
    MiB here, ~70% of the write's CPU with the CRC-32 and fsync), which an asynchronous save takes
    from the training loop beside it where no core is spare. Here each piece of a tensor is copied
    into a 1 MiB bounce buffer that stays in cache, summed there, and the disk reads it by DMA. The
    tensors' own bytes cannot go straight to the disk: O_DIRECT needs the memory address and the
    file offset aligned alike, and safetensors packs tensors back to back. The header is padded with
    spaces so that the data starts on a 4096-byte boundary (legal safetensors: any reader skips
    them); what is on disk is otherwise the buffered writer's, byte for byte.
    """

    def __init__(self, fd: int, offset: int) -> None:
        assert _direct is not None and offset % _DIRECT_ALIGN == 0
        self.fd, self.offset, self.fill = fd, offset, 0
        # One per write (1 MiB: ~0.1 ms of page faults against a write of 8 MiB or more), not kept alive
        # between saves.
        raw = np.empty(_BOUNCE_BYTES + _DIRECT_ALIGN, np.uint8)
        start = -raw.ctypes.data % _DIRECT_ALIGN
        self.bounce = raw[start : start + _BOUNCE_BYTES]

    @classmethod
    def open(cls, path: str, offset: int) -> _DirectStream | None:
        """A stream writing ``path`` from ``offset`` (aligned) with O_DIRECT, or None where the file
        system refuses it (tmpfs: at open; others at the first write, which this probes with one block)."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_DIRECT | _CLOEXEC)
        except OSError:
            return None
        stream = cls(fd, offset)
        try:
            os.pwrite(fd, memoryview(stream.bounce)[:_DIRECT_ALIGN], offset)  # rewritten by the data
        except OSError:
            os.close(fd)
            return None
        return stream

    def append(self, buf: memoryview) -> int:
        assert _direct is not None
        crc, self.fill, self.offset = _direct[0](self.fd, buf, self.bounce, self.fill, self.offset)
        return crc

    def finish(self) -> None:
        """Writes what the bounce buffer holds and cuts the file to its length."""
        assert _direct is not None
        _direct[1](self.fd, self.bounce, self.fill, self.offset)


def _crc_through(buf: memoryview, io: Callable[[memoryview], None]) -> int:
    """Passes ``buf`` to ``io`` chunk by chunk (a write from it, or a read into it) and returns its CRC-32.

    Each chunk is summed right after its I/O. A helper thread summing behind the I/O was tried
    (``zlib.crc32`` releases the GIL): 18 ms instead of 30 ms for 64 MiB on an idle machine, but 3x
    slower than this under load from other processes (the threads hand the GIL to each other on
    every chunk and wait for the CPU each time); the native CRC-32 made the overlap unnecessary.
    """
    crc = 0
    for start in range(0, len(buf), _CHUNK):
        chunk = buf[start : start + _CHUNK]
        io(chunk)
        crc = _crc32(chunk, crc)
    return crc


def _write_all(fd: int, data: memoryview | bytes) -> None:
    """``os.write`` until every byte of ``data`` is written (a write may be short)."""
    view = memoryview(data)
    while len(view):
        n = os.write(fd, view)
        if n == 0:  # no progress and no error: never retried into a hang
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        view = view[n:]


def _write_with_crc(fd: int, buf: memoryview) -> int:
    """Writes ``buf`` to ``fd`` at its offset, 1 MiB at a time, and returns its CRC-32.

    Natively where ``cudist._core`` has it (:data:`_write_crc32`): the GIL is released for the whole
    tensor. The Python loop took it back after each write and each CRC, ~500 times per 256 MiB, and an
    asynchronous save's thread then waited behind the training loop's thread for it and held that
    thread up each time it had it. Both sum each chunk right after writing it, while it is in cache.
    """
    if _write_crc32 is not None:
        return _write_crc32(fd, buf, _CHUNK)
    return _crc_through(buf, lambda chunk: _write_all(fd, chunk))


def _crc_hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


def _index_crc(index: dict[str, Any]) -> str:
    """The CRC-32 of an index's canonical JSON (sorted keys, no spaces), its ``crc32`` field left out."""
    body = {k: v for k, v in index.items() if k != "crc32"}
    return _crc_hex(_crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8"), 0))


# ------------------------------------------------------------------------------------- files
def fsync_dir(directory: str) -> None:
    """Makes renames and creations in ``directory`` durable (a no-op where directories can't be opened)."""
    flags = getattr(os, "O_DIRECTORY", None)
    if flags is None:  # Windows: no directory fsync
        return
    fd = os.open(directory, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _try_lock(fd: int, blocking: bool) -> bool:
    """An exclusive flock on ``fd``; False if another open file holds one (and not ``blocking``)."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError:  # a file system without flock: as without fcntl
        return True
    return True


def _temp_name(directory: str, final: str) -> str:
    return os.path.join(directory, f".{os.path.basename(final)}.{secrets.token_hex(4)}.tmp")


def _create_locked(directory: str, final: str) -> tuple[int, str]:
    """A new hidden temporary file for ``final``, open for writing and exclusively locked until closed.

    The lock tells cleaners (:func:`_remove_unheld`) that its writer is alive. A cleaner may lock and
    unlink a brand-new file in the instant before its creator locks it: the name is then checked to
    still be this file, and another one made if not.
    """
    while True:
        tmp = _temp_name(directory, final)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o666)
        _try_lock(fd, blocking=True)
        try:
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                return fd, tmp
        except FileNotFoundError:
            pass
        os.close(fd)


def _remove_unheld(path: str, still_named: Callable[[], bool] = lambda: False) -> None:
    """Removes ``path`` unless a live writer holds its lock or (asked with the lock held) an index names it.

    A writer commits an index naming a file only while it holds that file's lock, so what an index
    says once the lock is ours stays true until we let it go.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC)
    except OSError:
        return
    try:
        if _try_lock(fd, blocking=False) and not still_named():
            with contextlib.suppress(OSError):
                os.remove(path)
    finally:
        os.close(fd)


def open_regular(path: str) -> BinaryIO:
    """``path`` opened for reading, refusing anything but a regular file (a FIFO would block, a
    device never end).

    Raises:
        OSError: it cannot be opened (FileNotFoundError, PermissionError: not a damaged file).
        DataLossError: it is not a regular file.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _data_loss(path, "not a regular file (a checkpoint file cannot be a FIFO, device or directory)")
    return os.fdopen(fd, "rb")


def _parse_json(raw: bytes, path: str, what: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, a 5000-digit int; deep nesting
        raise _data_loss(path, f"{what} is not valid JSON ({type(e).__name__}: {e})") from None


def read_json(path: str, what: str) -> Any:
    """The JSON value in ``path``, read only if it is a regular file of at most :data:`MAX_JSON_BYTES`.

    Raises:
        OSError: it cannot be opened (FileNotFoundError: there is none).
        DataLossError: anything else wrong (naming ``path`` and ``what`` it should have been).
    """
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_JSON_BYTES:
            raise _data_loss(path, f"{what} of {size} bytes is over the {MAX_JSON_BYTES}-byte limit")
        raw = f.read(size + 1)  # (read() preallocates what it is asked for: not the limit)
    if len(raw) > MAX_JSON_BYTES:
        raise _data_loss(path, f"{what} grew over the {MAX_JSON_BYTES}-byte limit while being read")
    return _parse_json(raw, path, what)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Writes ``path`` all or nothing: a temporary file, fsync, rename, directory fsync."""
    directory = os.path.dirname(path) or "."
    fd, tmp = _create_locked(directory, path)
    try:
        with os.fdopen(os.dup(fd), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    finally:
        os.close(fd)
    fsync_dir(directory)


def atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode("utf-8"))


# ------------------------------------------------------------------------------------- writing
def _nbytes(dtype: npt.DTypeLike, shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _data_bytes(specs: Sequence[TensorSpec]) -> int:
    return sum(_nbytes(dtype, shape) for _, dtype, shape, _ in specs)


def _header(specs: Sequence[TensorSpec], metadata: dict[str, str], crcs: dict[str, str], align: int = 8) -> bytes:
    """The safetensors header, padded with spaces so that the data (after the 8-byte length) starts
    at a multiple of ``align``."""
    header: dict[str, Any] = {}
    offset = 0
    for key, dtype, shape, _ in specs:
        code, stored_shape = _stored(dtype, shape)
        nbytes = _nbytes(dtype, shape)
        header[key] = {"dtype": code, "shape": stored_shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    meta = {"format": FORMAT, "version": str(VERSION), **metadata}
    meta.update((_CRC_PREFIX + key, crcs.get(key, "00000000")) for key, *_ in specs)
    header["__metadata__"] = meta
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # safetensors aligns the data on 8 bytes (spaces, as the library pads); O_DIRECT wants 4096 (see _DirectStream)
    return head + b" " * (-(8 + len(head)) % align)


def _write_tensor_data(write: Callable[[memoryview], int], specs: Sequence[TensorSpec], crcs: dict[str, str]) -> None:
    """Writes each tensor's bytes through ``write`` (which returns their CRC-32), recording the CRC-32s."""
    for key, dtype, shape, get in specs:
        arr = get()
        if not isinstance(arr, np.ndarray):
            arr = np.asarray(arr)
        if arr.dtype != np.dtype(dtype) or arr.shape != tuple(shape):
            raise RuntimeError(
                f"checkpoint tensor {key!r} changed while being saved: {arr.dtype}{list(arr.shape)}, "
                f"expected {np.dtype(dtype)}{list(shape)}"
            )
        arr = _little(arr)
        crcs[key] = _crc_hex(write(_bytes_of(arr)) if arr.size else 0)
        del arr
        tensor_written(key)


def write_checkpoint(prefix: str, specs: Sequence[TensorSpec], make_index: Callable[[str], dict[str, Any]]) -> None:
    """Writes the checkpoint at ``prefix``: its tensors file, then its index (the commit point).

    ``specs``: (key, dtype, shape, get) tuples; ``get()`` returns the host array, called once per
    tensor, in order, so only one tensor's data needs to exist at a time (host arrays are written
    straight from their storage). The header is written first with placeholder checksums and
    rewritten (the same length) once the data is. ``make_index(tensors file name)`` gives the index,
    to which this adds ``format``, ``version`` and its ``crc32``. A failure before the commit
    removes what this write made; after it, the prefix's other tensors files and debris nobody holds
    are removed.
    """
    directory = os.path.dirname(prefix) or "."
    base = os.path.basename(prefix)
    name = f"{base}{DATA_INFIX}{secrets.token_hex(4)}{DATA_SUFFIX}"
    final = os.path.join(directory, name)
    fd, tmp = _create_locked(directory, final)
    current = tmp  # the name our file has
    try:
        try:  # straight to the descriptor: the tensors' bytes go from their arrays to write(2)
            meta = {"index": base + INDEX_SUFFIX}
            crcs: dict[str, str] = {}
            direct = _direct is not None and _data_bytes(specs) >= _DIRECT_MIN_BYTES and _settings.checkpoint_direct_io()
            align = _DIRECT_ALIGN if direct else 8
            head = _header(specs, meta, crcs, align)
            _write_all(fd, struct.pack("<Q", len(head)) + head)
            stream = _DirectStream.open(tmp, 8 + len(head)) if direct else None
            if stream is None:
                _write_tensor_data(functools.partial(_write_with_crc, fd), specs, crcs)
            else:
                try:
                    _write_tensor_data(stream.append, specs, crcs)
                    stream.finish()
                finally:
                    os.close(stream.fd)
            head = _header(specs, meta, crcs, align)  # the same length: only the checksums' hex digits changed
            os.lseek(fd, 8, os.SEEK_SET)
            _write_all(fd, head)
            os.fsync(fd)
        except OSError as e:
            raise _naming(e, tmp) from None
        os.replace(tmp, final)
        current = final
        fsync_dir(directory)
        before_commit(prefix)
        index = {"format": FORMAT, "version": VERSION, **make_index(name)}
        index["crc32"] = _index_crc(index)
        atomic_write_json(prefix + INDEX_SUFFIX, index)  # the commit point
        current = ""
    except BaseException:
        if current:  # ours and named by no index: an orphan if left (e.g. no space left for the index)
            with contextlib.suppress(OSError):
                os.remove(current)
        raise
    finally:
        os.close(fd)  # releases the lock: from here cleaners may remove the file if no index names it
    remove_stale(directory, base)


def _naming(e: OSError, path: str) -> OSError:
    """``e`` with ``path`` as its file name, if it has none (the native writer's and ``os.write``'s
    errors name no file); the same subclass and errno."""
    if e.filename is not None or e.errno is None:
        return e
    return type(e)(e.errno, e.strerror, path)


def tensor_written(key: str) -> None:
    """Called after each tensor is written (a seam for tests that interrupt a save mid-file)."""


def before_commit(prefix: str) -> None:
    """Called when a checkpoint's tensors are on disk, just before its index commits it (a seam for
    tests that kill a save at its most delicate point)."""


# ------------------------------------------------------------------------------------- cleaning up
_HEX8 = "[0-9a-f]{8}"


def _own_files(directory: str, base_pattern: str) -> list[tuple[str, str]]:
    """(file name, checkpoint base) of the tensors and temporary files in ``directory`` of the bases
    ``base_pattern`` (a regular expression) matches."""
    pattern = re.compile(
        rf"(?P<tmp>\.)?(?P<base>{base_pattern})"
        rf"(?:{re.escape(DATA_INFIX)}{_HEX8}{re.escape(DATA_SUFFIX)}|{re.escape(INDEX_SUFFIX)})"
        rf"(?(tmp)\.{_HEX8}\.tmp|)"
    )
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    out = []
    for name in names:
        m = pattern.fullmatch(name)
        if m and (m.group("tmp") or not name.endswith(INDEX_SUFFIX)):
            out.append((name, m.group("base")))
    return out


def _named_tensors(prefix: str) -> str | None:
    """The tensors file the index at ``prefix`` names, "" if there is no index, None if it is unreadable."""
    try:
        index = read_json(prefix + INDEX_SUFFIX, "checkpoint index")
    except FileNotFoundError:
        return ""
    except (DataLossError, OSError):
        return None
    tensors = index.get("tensors") if isinstance(index, dict) else None
    return tensors if isinstance(tensors, str) else None


def _sweep(directory: str, base_pattern: str, indexed_too: bool = True) -> None:
    """Removes the tensors and temporary files of the bases ``base_pattern`` matches that nobody holds
    and no index names; with ``indexed_too`` False, only tensors files whose base has no index (so a
    sweep of a whole name reads no index: a manager keeping thousands stays cheap)."""
    for name, base in _own_files(directory, base_pattern):
        prefix = os.path.join(directory, base)
        if name.startswith("."):
            _remove_unheld(os.path.join(directory, name))  # a temporary file: only its writer wants it
        elif indexed_too or not os.path.lexists(prefix + INDEX_SUFFIX):
            # An unreadable index (None) may name any file: keep them all.
            _remove_unheld(os.path.join(directory, name), lambda p=prefix, n=name: _named_tensors(p) in (None, n))


def remove_stale(directory: str, base: str) -> None:
    """Removes ``base``'s tensors files its index does not name, and the temporary files of dead writers."""
    _sweep(directory, re.escape(base))


def remove_orphans(directory: str, name: str) -> None:
    """Removes what saves of the numbered checkpoints ``<name>-<n>`` in ``directory`` interrupted by a
    crash or a full disk left: temporary files nobody holds, and tensors files without an index."""
    _sweep(directory, re.escape(name) + r"-(?:-?[0-9]+)", indexed_too=False)


def remove_checkpoint(prefix: str) -> None:
    """Deletes a checkpoint: its index first (so it stops existing at once), then its tensors files."""
    with contextlib.suppress(OSError):
        os.remove(prefix + INDEX_SUFFIX)
    remove_stale(os.path.dirname(prefix) or ".", os.path.basename(prefix))


# ------------------------------------------------------------------------------------- reading
def _check_list(x: object, what: Callable[[object], bool]) -> bool:
    return isinstance(x, list) and all(what(i) for i in x)


def _is_str(x: object) -> bool:
    return isinstance(x, str)


def _check_record(path: str, rec: object, bad: Callable[[str], Exception]) -> None:
    if not isinstance(rec, dict):
        raise bad(f"object {path!r} is not a record")
    kind = rec.get("kind")
    if kind in ("variable", "slot"):
        if not isinstance(rec.get("tensor"), str):
            raise bad(f"object {path!r} names no tensor")
        if rec.get("dtype") not in DTYPE_NAMES:
            raise bad(f"object {path!r} has dtype {rec.get('dtype')!r}")
        if not _check_list(rec.get("shape"), _is_count):
            raise bad(f"object {path!r} has shape {rec.get('shape')!r}")
        if "per_replica" in rec and not _check_list(rec["per_replica"], _is_str):
            raise bad(f"object {path!r} has per_replica {rec['per_replica']!r}")
        if kind == "slot" and not all(isinstance(rec.get(k), str) for k in ("optimizer", "variable", "slot")):
            raise bad(f"slot {path!r} lacks its optimizer, variable or slot name")
    elif kind == "optimizer":
        hyper = rec.get("hyperparameters")
        if not isinstance(hyper, dict):
            raise bad(f"optimizer {path!r} has no hyperparameters")
        lr = hyper.get("learning_rate")
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr)):
            raise bad(f"optimizer {path!r} has learning rate {lr!r} (a finite number or null)")
        slots = rec.get("slots", {})
        if not isinstance(slots, dict) or not all(
            isinstance(v, dict) and all(isinstance(s, str) for s in v.values()) for v in slots.values()
        ):
            raise bad(f"optimizer {path!r} has slots {slots!r}")
    elif kind == "iterator":
        if not _is_count(rec.get("position")):
            raise bad(f"iterator {path!r} has position {rec.get('position')!r} (an integer >= 0)")
    else:
        raise bad(f"object {path!r} has kind {kind!r}")


def read_index(prefix: str) -> dict[str, Any]:
    """The index of the checkpoint at ``prefix``, checked: its checksum (version 2), its fields and
    records, and that its tensors file is ``<prefix>.data-<8 hex>.safetensors`` in its directory.

    Raises:
        FileNotFoundError: there is no index.
        DataLossError: anything wrong with it.
    """
    path = prefix + INDEX_SUFFIX

    def bad(what: str) -> DataLossError:
        return _data_loss(path, what)

    index = read_json(path, "checkpoint index")
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise bad("not a cudist checkpoint index")
    version = index.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise bad(f"checkpoint format version {version!r}; this cudist reads {', '.join(map(str, READABLE_VERSIONS))}")
    if version >= 2 and index.get("crc32") != _index_crc(index):
        raise bad(f"checksum mismatch: the index records {index.get('crc32')!r}, its content sums to {_index_crc(index)!r}")
    tensors = index.get("tensors")
    base = re.escape(os.path.basename(prefix))
    if not isinstance(tensors, str) or not re.fullmatch(rf"{base}{re.escape(DATA_INFIX)}{_HEX8}{re.escape(DATA_SUFFIX)}", tensors):
        raise bad(f"names the tensors file {tensors!r}, not {os.path.basename(prefix)}{DATA_INFIX}<8 hex digits>{DATA_SUFFIX} beside it")
    counter = index.get("save_counter")
    if counter is not None and type(counter) is not int:
        raise bad(f"save_counter is {counter!r}")
    objects = index.get("objects")
    if not isinstance(objects, dict):
        raise bad("has no objects")
    for p, rec in objects.items():
        _check_record(p, rec, bad)
    sc = objects.get("save_counter")
    if sc is not None and (sc.get("kind") != "variable" or sc.get("dtype") != "int64" or sc.get("shape") != []):
        raise bad("save_counter is not a scalar int64 variable")
    return index


def tensor_shapes(index: dict[str, Any]) -> dict[str, tuple[str, list[int]]]:
    """Every tensor key a (checked) index names, with the dtype name and shape its records give it."""
    shapes: dict[str, tuple[str, list[int]]] = {}
    for rec in index["objects"].values():
        if "tensor" in rec:
            for key in [rec["tensor"], *(rec.get("per_replica") or ())]:
                shapes[key] = (rec["dtype"], rec["shape"])
    return shapes


class TensorReader:
    """Reads the tensors an index names from its safetensors file, checked before anything is read.

    Args:
        path: the tensors file.
        expected: tensor key -> (dtype name, shape), as the index records them.
        index_name: the index's file name (the header's ``index`` metadata must agree).
        version: the index's format version (from 2, the header must carry a CRC-32 per tensor,
            and its metadata the format, version and index name).

    Raises:
        DataLossError: the file is missing, not a regular file, or its header is malformed, over
            :data:`MAX_JSON_BYTES`, disagrees with the index, or does not tile the data exactly.
    """

    def __init__(self, path: str, expected: dict[str, tuple[str, list[int]]], index_name: str, version: int):
        self.path = path
        try:
            self._file = open_regular(path)
        except FileNotFoundError:
            raise _data_loss(path, "the tensors file the index names is missing") from None
        try:
            self._check_header(expected, index_name, version)
        except BaseException:
            self._file.close()
            raise

    def _bad(self, what: str) -> DataLossError:
        return _data_loss(self.path, what)

    def _check_header(self, expected: dict[str, tuple[str, list[int]]], index_name: str, version: int) -> None:
        raw = self._file.read(8)
        size = os.fstat(self._file.fileno()).st_size
        if len(raw) != 8:
            raise self._bad(f"not a safetensors file ({size} bytes, shorter than its header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_JSON_BYTES:
            raise self._bad(f"header length {n} is over the {MAX_JSON_BYTES}-byte limit")
        if n > size - 8:
            raise self._bad(f"header length {n} goes beyond the file's {size} bytes (truncated?)")
        header = _parse_json(self._file.read(n), self.path, "the safetensors header")
        if not isinstance(header, dict):
            raise self._bad("the safetensors header is not a JSON object")
        meta = header.pop("__metadata__", {})
        if meta is None:  # safetensors accepts a null metadata
            meta = {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise self._bad("the header's __metadata__ is not a map of strings")
        # Version 2 files record all three (so a flip in them is caught too); version 1 files may not.
        for field, value in (("format", FORMAT), ("version", str(version)), ("index", index_name)):
            if meta.get(field, None if version >= 2 else value) != value:
                raise self._bad(f"the header's {field} is {meta.get(field)!r}, not {value!r}")
        self._start = 8 + n
        data_size = size - self._start
        spans = []
        for key, e in header.items():
            if not isinstance(e, dict) or e.get("dtype") not in _DTYPES or not _check_list(e.get("shape"), _is_count):
                raise self._bad(f"tensor {key!r} has a malformed header entry {e!r}")
            offsets = e.get("data_offsets")
            if not (_check_list(offsets, _is_count) and len(offsets) == 2 and offsets[0] <= offsets[1]):
                raise self._bad(f"tensor {key!r} has data_offsets {offsets!r}")
            nbytes = math.prod(e["shape"]) * _DTYPES[e["dtype"]].itemsize
            if offsets[1] - offsets[0] != nbytes:
                raise self._bad(f"tensor {key!r} spans {offsets[1] - offsets[0]} bytes; its dtype and shape make {nbytes}")
            spans.append((offsets[0], offsets[1], key))
        end = 0
        for begin, stop, key in sorted(spans):
            if begin != end:
                raise self._bad(f"tensor {key!r} starts at byte {begin} of the data, not {end} (a gap or an overlap)")
            end = stop
        if end != data_size:
            raise self._bad(f"the header describes {end} bytes of data, the file has {data_size} (truncated?)")
        self._entries: dict[str, tuple[int, int, int | None]] = {}
        for key, (dtype, shape) in expected.items():
            e = header.get(key)
            if e is None:
                raise self._bad(f"the index names tensor {key!r}, which the file lacks")
            code, stored_shape = _stored(dtype, shape)
            if e["dtype"] != code or e["shape"] != stored_shape:
                raise self._bad(f"tensor {key!r} is {e['dtype']}{e['shape']} here but {dtype}{list(shape)} in the index")
            crc = meta.get(_CRC_PREFIX + key)
            if crc is None and version >= 2:
                raise self._bad(f"tensor {key!r} has no checksum")
            if crc is not None and not re.fullmatch(_HEX8, crc):
                raise self._bad(f"tensor {key!r} has the malformed checksum {crc!r}")
            begin, stop = e["data_offsets"]
            self._entries[key] = (self._start + begin, stop - begin, None if crc is None else int(crc, 16))

    def nbytes(self, key: str) -> int:
        """The size of tensor ``key``'s data."""
        return self._entries[key][1]

    def read(self, key: str, dtype: npt.DTypeLike, shape: Sequence[int], verify: bool = True) -> npt.NDArray[Any]:
        """Tensor ``key`` as a new host array of ``dtype`` and ``shape`` (as the index records them;
        checked against the header when this reader was made), its CRC-32 checked if ``verify``
        (a version 1 file has none).

        Raises:
            DataLossError: the data does not match its checksum, or the file shrank meanwhile.
        """
        offset, nbytes, crc = self._entries[key]
        dtype = _np_dtype(dtype)
        out = np.empty(tuple(shape), dtype=dtype.newbyteorder("<"))
        f = self._file
        f.seek(offset)

        def fill(view: memoryview) -> None:
            got = f.readinto(view)
            if got != len(view):
                raise self._bad(f"ended while tensor {key!r} was read (truncated meanwhile?)")

        if nbytes:
            if verify and crc is not None:
                got = _crc_through(_bytes_of(out), fill)
                if got != crc:
                    raise self._bad(
                        f"tensor {key!r} is corrupt: its data sums to {_crc_hex(got)}, the header records {_crc_hex(crc)}"
                    )
            else:
                fill(_bytes_of(out))
        elif verify and crc not in (None, 0):
            raise self._bad(f"tensor {key!r} is corrupt: empty, but the header records the checksum {_crc_hex(crc)}")
        return out if _LITTLE else out.astype(dtype.newbyteorder("="))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------- state file
#: The state file of a checkpoint directory (TF's name; JSON with the fields of TF's CheckpointState).
STATE_FILE = "checkpoint"


def is_bare_name(name: object) -> bool:
    """Whether a state file's path names a file directly in its directory (no separator, not . or ..)."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and os.sep not in name
        and (os.altsep is None or os.altsep not in name)
        and "\0" not in name
    )


def numbered(name: str) -> re.Pattern[str]:
    """The checkpoint names ``<name>-<n>`` that a manager or ``Checkpoint.save`` of ``name`` writes."""
    return re.compile(re.escape(name) + r"-(-?[0-9]+)")


def read_state(directory: str, state_file: str = STATE_FILE) -> dict[str, Any] | None:
    """``directory``'s state file, or None if there is none or it cannot be read (logged, as TF does).

    Returns TF's fields with the paths joined to ``directory`` and ``entries``: (path, timestamp or
    None) of ``all_model_checkpoint_paths``. Only paths of files directly in ``directory`` are kept
    (a path elsewhere is logged and dropped: what a state file names may be deleted by a manager);
    ``model_checkpoint_path`` is None if it names one elsewhere.
    """
    path = os.path.join(directory, state_file)
    try:
        state = read_json(path, "checkpoint state file")
    except FileNotFoundError:
        return None
    except (DataLossError, OSError) as e:
        _log.warning("%s; checkpoint state ignored", e)
        return None
    if not isinstance(state, dict) or not isinstance(state.get("model_checkpoint_path"), str):
        _log.warning("%s: not a checkpoint state file (no model_checkpoint_path); ignored", path)
        return None
    paths = state.get("all_model_checkpoint_paths") or []
    stamps = state.get("all_model_checkpoint_timestamps") or []
    if not isinstance(paths, list) or not isinstance(stamps, list) or len(stamps) not in (0, len(paths)):
        _log.warning("%s: malformed all_model_checkpoint_paths/timestamps; ignored", path)
        paths, stamps = [], []
    entries = []
    for i, p in enumerate(paths):
        stamp = stamps[i] if stamps else None
        if not is_bare_name(p):
            _log.warning("%s: ignoring %r, which is not a checkpoint in that directory", path, p)
        elif stamp is not None and (isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not math.isfinite(stamp)):
            entries.append((os.path.join(directory, p), None))
        else:
            entries.append((os.path.join(directory, p), stamp))
    latest = state["model_checkpoint_path"]
    if not is_bare_name(latest):
        _log.warning("%s: ignoring model_checkpoint_path %r, which is not a checkpoint in that directory", path, latest)
    preserved = state.get("last_preserved_timestamp")
    return {
        "model_checkpoint_path": os.path.join(directory, latest) if is_bare_name(latest) else None,
        "entries": entries,
        "last_preserved_timestamp": preserved if isinstance(preserved, (int, float)) and not isinstance(preserved, bool) and math.isfinite(preserved) else None,
    }


@contextlib.contextmanager
def _directory_lock(directory: str) -> Any:
    """An exclusive flock on ``directory`` itself: state file updates read, merge and write under it."""
    flags = getattr(os, "O_DIRECTORY", None)
    if fcntl is None or flags is None:
        yield
        return
    fd = os.open(directory, os.O_RDONLY | flags | _CLOEXEC)
    try:
        _try_lock(fd, blocking=True)
        yield
    finally:
        os.close(fd)


def write_state(
    directory: str,
    latest: str,
    owner: str,
    entries: Iterable[tuple[str, float | None]],
    last_preserved: float | None = None,
    state_file: str = STATE_FILE,
) -> None:
    """Atomically records ``latest`` and ``owner``'s checkpoints in ``directory``'s state file.

    ``entries``: (path, timestamp or None) of the checkpoints named ``<owner>-<n>`` to list, oldest
    first; the file's entries of other names (another manager's) are kept, before them. JSON with
    TF's ``CheckpointState`` fields (``model_checkpoint_path``, ``all_model_checkpoint_paths``,
    ``all_model_checkpoint_timestamps`` when every entry has one, ``last_preserved_timestamp``);
    paths are relative to ``directory``, as TF stores them.
    """
    mine = numbered(owner)
    with _directory_lock(directory):
        old = read_state(directory, state_file)
        others = [] if old is None else [(p, t) for p, t in old["entries"] if not mine.fullmatch(os.path.basename(p))]
        listed = others + list(entries)
        state: dict[str, Any] = {
            "model_checkpoint_path": os.path.basename(latest),
            "all_model_checkpoint_paths": [os.path.basename(p) for p, _ in listed],
        }
        if listed and all(t is not None for _, t in listed):
            state["all_model_checkpoint_timestamps"] = [t for _, t in listed]
        if last_preserved is not None:
            state["last_preserved_timestamp"] = last_preserved
        atomic_write_json(os.path.join(directory, state_file), state)
        for name in os.listdir(directory):
            if name.startswith(f".{state_file}.") and name.endswith(".tmp"):
                _remove_unheld(os.path.join(directory, name))  # left by a process killed while writing it


def exists(prefix: str) -> bool:
    """Whether a committed checkpoint is at ``prefix`` (its index exists)."""
    return os.path.isfile(prefix + INDEX_SUFFIX)
