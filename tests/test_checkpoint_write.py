"""The checkpoint tensor writer: ``cudist._core.write_crc32`` (one native call per tensor, no GIL)
against the Python loop it replaces (``os.write`` + CRC-32 per 1 MiB chunk), byte for byte and CRC for CRC."""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
import zlib

import numpy as np
import pytest

import cudist
from cudist import train
from cudist.train import _format

core = pytest.importorskip("cudist._core")
if not hasattr(core, "write_crc32"):
    pytest.skip("cudist._core has no write_crc32 on this platform", allow_module_level=True)

MiB = 1 << 20


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("chunk", [4096, MiB])
def test_every_byte_is_written_at_the_offset_and_the_crc_is_zlibs(tmp_path, chunk):
    rng = np.random.default_rng(29)
    sizes = [0, 1, chunk - 1, chunk, chunk + 1, 2 * chunk + 3, 5 * chunk // 2]
    for n in sizes:
        data = rng.integers(0, 256, n, dtype=np.uint8)
        for seed in (0, 0xFFFFFFFF, 0x1234567):
            path = str(tmp_path / f"f{n}_{seed}")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                os.write(fd, b"head")  # the native write continues at the descriptor's offset
                crc = core.write_crc32(fd, data, chunk, seed)
                os.write(fd, b"tail")
            finally:
                os.close(fd)
            assert crc == zlib.crc32(data, seed), (n, seed)
            assert _read(path) == b"head" + data.tobytes() + b"tail", (n, seed)


def test_buffers_of_any_kind_and_dtype_and_a_strided_one_refused(tmp_path):
    rng = np.random.default_rng(1)
    arr = rng.standard_normal(300_001).astype(np.float32)
    raw = arr.tobytes()
    fd = os.open(str(tmp_path / "f"), os.O_WRONLY | os.O_CREAT)
    try:
        assert core.write_crc32(fd, arr) == zlib.crc32(raw)  # a float32 array's bytes
        assert core.write_crc32(fd, memoryview(raw)[5:]) == zlib.crc32(raw[5:])
        assert core.write_crc32(fd, bytearray(raw[:1001])) == zlib.crc32(raw[:1001])
        before = os.lseek(fd, 0, os.SEEK_CUR)
        with pytest.raises(ValueError, match="not C-contiguous"):  # numpy's buffer export refuses it
            core.write_crc32(fd, arr[::2])
        with pytest.raises(ValueError, match="chunk must be positive"):
            core.write_crc32(fd, raw, 0)
        assert os.lseek(fd, 0, os.SEEK_CUR) == before  # nothing written by a refused call
    finally:
        os.close(fd)
    assert _read(str(tmp_path / "f")) == raw + raw[5:] + raw[:1001]


def test_failed_writes_raise_oserror_with_the_errno(tmp_path):
    data = np.random.default_rng(2).integers(0, 256, 3 * MiB + 5, dtype=np.uint8)
    path = str(tmp_path / "ro")
    open(path, "wb").close()
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:  # a descriptor not open for writing
            core.write_crc32(fd, data)
        assert info.value.errno == errno.EBADF
    finally:
        os.close(fd)
    with pytest.raises(OSError) as info:  # a closed descriptor
        core.write_crc32(fd, data)
    assert info.value.errno == errno.EBADF
    if os.path.exists("/dev/full"):  # a full disk (a small tmpfs is not available to the tests)
        full = os.open("/dev/full", os.O_WRONLY)
        try:
            with pytest.raises(OSError) as info:
                core.write_crc32(full, data)
            assert info.value.errno == errno.ENOSPC and type(info.value) is OSError
        finally:
            os.close(full)


@pytest.mark.skipif(sys.platform == "win32", reason="pthread_kill and pipes' blocking writes are POSIX")
@pytest.mark.parametrize("raising", [False, True])
def test_a_signal_during_a_blocked_write_runs_handlers_and_the_write_continues_or_ends(raising):
    """A pipe nobody reads yet blocks the write after its capacity; SIGUSR1 to this (the main) thread
    then interrupts it (a short count or EINTR). The handler must run during the write (as between
    two os.write calls); one that raises ends it, one that does not lets every byte through."""
    data = np.random.default_rng(3).integers(0, 256, 3 * MiB + 7, dtype=np.uint8)
    r, w = os.pipe()
    got = bytearray()
    state = {"writing": False, "calls": [], "done": threading.Event(), "read": threading.Event()}

    class Stop(Exception):
        pass

    def handler(signum, frame):
        state["calls"].append(state["writing"])
        state["read"].set()  # from the first signal on, the reader drains the pipe
        if raising:
            raise Stop

    def signaller():
        main = threading.main_thread().ident
        while not state["done"].wait(0.05):
            signal.pthread_kill(main, signal.SIGUSR1)

    def reader():
        state["read"].wait(30)
        while chunk := os.read(r, 1 << 16):
            got.extend(chunk)
            time.sleep(0.0005)  # slow: the writer blocks again and again

    old = signal.signal(signal.SIGUSR1, handler)
    threads = [threading.Thread(target=signaller), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    try:
        state["writing"] = True
        if raising:
            with pytest.raises(Stop):
                core.write_crc32(w, data)
        else:
            crc = core.write_crc32(w, data)
        state["writing"] = False
    finally:
        state["done"].set()
        os.close(w)
        for t in threads:
            t.join(30)
        os.close(r)
        signal.signal(signal.SIGUSR1, old)
    assert state["calls"] and state["calls"][0] is True  # the handler ran inside the native write
    if raising:
        assert len(got) < data.nbytes and bytes(got) == data.tobytes()[: len(got)]
    else:
        assert bytes(got) == data.tobytes() and crc == zlib.crc32(data)


def _save(prefix, arrays):
    variables = {f"v{i}": cudist.Variable(a) for i, a in enumerate(arrays)}
    return train.Checkpoint(**variables).write(prefix)


def _tensors_file(prefix):
    directory, base = os.path.split(prefix)
    (name,) = [n for n in os.listdir(directory) if n.startswith(base + _format.DATA_INFIX)]
    return os.path.join(directory, name)


def test_native_and_python_writers_write_the_same_bytes(tmp_path, monkeypatch):
    rng = np.random.default_rng(4)
    arrays = [
        rng.standard_normal((1 << 18) + 3).astype(np.float32),  # over one chunk, odd
        rng.standard_normal((1 << 17) - 1),  # float64, just under a chunk
        rng.integers(-(2**31), 2**31, 7, dtype=np.int32),
        np.zeros((0, 3), np.float32),
        rng.standard_normal(1).astype(np.float16),
    ]
    assert _format._write_crc32 is core.write_crc32 or not core.crc32_accelerated
    (tmp_path / "native").mkdir()
    (tmp_path / "python").mkdir()
    native = _save(str(tmp_path / "native" / "ckpt"), arrays)
    monkeypatch.setattr(_format, "_write_crc32", None)
    python = _save(str(tmp_path / "python" / "ckpt"), arrays)
    assert _read(_tensors_file(native)) == _read(_tensors_file(python))
    for prefix in (native, python):
        restored = {f"v{i}": cudist.Variable(np.zeros_like(a)) for i, a in enumerate(arrays)}
        train.Checkpoint(**restored).read(prefix).assert_consumed()
        for i, a in enumerate(arrays):
            np.testing.assert_array_equal(restored[f"v{i}"].numpy(), a)


@pytest.mark.parametrize("native", [True, False])
def test_a_failed_tensor_write_names_the_file_and_leaves_nothing(tmp_path, monkeypatch, native):
    calls = []

    def no_space(fd, buf, chunk=MiB, value=0):
        calls.append(len(buf))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as the native writer raises: no file name

    if native:
        monkeypatch.setattr(_format, "_write_crc32", no_space)
    else:
        monkeypatch.setattr(_format, "_write_crc32", None)
        monkeypatch.setattr(_format.os, "write", lambda fd, data: no_space(fd, data))
    arrays = [np.arange(1000, dtype=np.float32)]
    with pytest.raises(OSError) as info:
        _save(str(tmp_path / "ckpt"), arrays)
    assert calls and info.value.errno == errno.ENOSPC
    assert info.value.filename.startswith(str(tmp_path / ".ckpt.data-")) and info.value.filename.endswith(".tmp")
    assert os.listdir(tmp_path) == []


def _aligned_bounce(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + 4096, np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start : start + nbytes]


@pytest.mark.parametrize("direct", [False, True])
def test_direct_appends_write_the_concatenation_and_each_pieces_crc(tmp_path, direct):
    """The O_DIRECT stream (through a bounce buffer) on pieces of odd sizes: the file holds exactly their
    concatenation after the header block, each CRC-32 is zlib's. ``direct=False``: the same calls on a
    buffered descriptor (the logic, on any file system)."""
    rng = np.random.default_rng(5)
    bounce = _aligned_bounce(16384)
    sizes = [0, 1, 4095, 4096, 4097, 16383, 16384, 16385, 3 * 16384 + 11, 7, 0, 40000]
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(b"h" * 4096)
    try:
        fd = os.open(path, os.O_WRONLY | (os.O_DIRECT if direct else 0))
    except OSError as e:
        pytest.skip(f"O_DIRECT refused on {tmp_path} ({e})")
    fill, offset = 0, 4096
    try:
        for data in pieces:
            crc, fill, offset = core.direct_append_crc32(fd, data, bounce, fill, offset, 0)
            assert crc == zlib.crc32(data) and offset % 4096 == 0 and 0 <= fill < bounce.nbytes
        core.direct_finish(fd, bounce, fill, offset)
    finally:
        os.close(fd)
    assert _read(path) == b"h" * 4096 + b"".join(p.tobytes() for p in pieces)


def test_direct_writes_refuse_unaligned_buffers_and_offsets_and_raise_oserror(tmp_path):
    bounce = _aligned_bounce(8192)
    fd = os.open(str(tmp_path / "f"), os.O_WRONLY | os.O_CREAT)
    try:
        for bad in (bounce[1:4097], bounce[:4095], bounce[:0]):
            with pytest.raises(ValueError, match="4096-aligned"):
                core.direct_append_crc32(fd, b"x", bad, 0, 0)
        with pytest.raises(ValueError, match="offset aligned"):
            core.direct_append_crc32(fd, b"x", bounce, 0, 100)
        with pytest.raises(ValueError, match="fill must be below"):
            core.direct_finish(fd, bounce, 8192, 0)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as info:  # closed: the first full bounce buffer fails to write
        core.direct_append_crc32(fd, np.zeros(9000, np.uint8), bounce, 0, 0)
    assert info.value.errno == errno.EBADF
    with pytest.raises(OSError) as info:
        core.direct_finish(fd, bounce, 10, 0)
    assert info.value.errno == errno.EBADF


def _big_arrays():
    rng = np.random.default_rng(6)
    return [  # 9 MiB and a bit, sizes that leave every tensor's file offset unaligned
        rng.standard_normal((1 << 20) + 3).astype(np.float32),
        rng.standard_normal((1 << 19) - 5),
        rng.integers(-100, 100, 1001, dtype=np.int16),
        rng.standard_normal((1 << 18) + 1).astype(np.float32),
    ]


def _header_length(path: str) -> int:
    with open(path, "rb") as f:
        return int.from_bytes(f.read(8), "little")


def test_large_checkpoints_go_through_o_direct_with_the_same_data_and_a_padded_header(tmp_path, monkeypatch):
    if _format._direct is None:
        pytest.skip("no O_DIRECT writer on this platform")
    probe = str(tmp_path / "probe")
    open(probe, "wb").close()
    stream = _format._DirectStream.open(probe, 0)
    if stream is None:
        pytest.skip(f"O_DIRECT refused on {tmp_path}")
    os.close(stream.fd)
    os.remove(probe)
    arrays = _big_arrays()
    assert sum(a.nbytes for a in arrays) >= _format._DIRECT_MIN_BYTES
    finished = []
    monkeypatch.setenv("CUDIST_CHECKPOINT_DIRECT_IO", "off")  # the default
    (tmp_path / "default").mkdir()
    default = _save(str(tmp_path / "default" / "ckpt"), arrays)
    assert finished == [] and (8 + _header_length(_tensors_file(default))) % 4096 != 0
    monkeypatch.setenv("CUDIST_CHECKPOINT_DIRECT_IO", "on")
    finish = _format._DirectStream.finish
    monkeypatch.setattr(_format._DirectStream, "finish", lambda self: (finished.append(1), finish(self))[1])
    (tmp_path / "direct").mkdir()
    (tmp_path / "buffered").mkdir()
    direct = _save(str(tmp_path / "direct" / "ckpt"), arrays)
    assert finished == [1]
    monkeypatch.setattr(_format, "_direct", None)
    buffered = _save(str(tmp_path / "buffered" / "ckpt"), arrays)
    assert finished == [1]
    d, b = _read(_tensors_file(direct)), _read(_tensors_file(buffered))
    dh, bh = _header_length(_tensors_file(direct)), _header_length(_tensors_file(buffered))
    assert (8 + dh) % 4096 == 0 and (8 + bh) % 8 == 0 and dh > bh
    # The same header but for the spaces after its JSON, the same data byte for byte.
    assert d[8 : 8 + dh].rstrip(b" ") == b[8 : 8 + bh].rstrip(b" ") and d[8 + dh :] == b[8 + bh :]
    assert _read(_tensors_file(default)) == b  # off and no O_DIRECT writer: the same file
    assert len(d) == 8 + dh + sum(a.nbytes for a in arrays)
    st = pytest.importorskip("safetensors.numpy")
    loaded = st.load_file(_tensors_file(direct))
    assert len(loaded) == len(arrays)
    restored = {f"v{i}": cudist.Variable(np.zeros_like(a)) for i, a in enumerate(arrays)}
    train.Checkpoint(**restored).read(direct).assert_consumed()
    for i, a in enumerate(arrays):
        np.testing.assert_array_equal(restored[f"v{i}"].numpy(), a)


def test_a_file_system_that_refuses_o_direct_gets_the_buffered_write(tmp_path, monkeypatch):
    if _format._direct is None:
        pytest.skip("no O_DIRECT writer on this platform")
    refused = []

    def no_direct(fd, data, offset):  # as a file system that opens with O_DIRECT but fails its writes
        refused.append(offset)
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(_format.os, "pwrite", no_direct)
    monkeypatch.setenv("CUDIST_CHECKPOINT_DIRECT_IO", "on")
    arrays = _big_arrays()
    path = _save(str(tmp_path / "ckpt"), arrays)
    assert len(refused) == 1 and (8 + _header_length(_tensors_file(path))) % 4096 == 0
    restored = {f"v{i}": cudist.Variable(np.zeros_like(a)) for i, a in enumerate(arrays)}
    train.Checkpoint(**restored).read(path).assert_consumed()
    for i, a in enumerate(arrays):
        np.testing.assert_array_equal(restored[f"v{i}"].numpy(), a)
