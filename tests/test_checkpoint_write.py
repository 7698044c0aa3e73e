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
