"""Thread CPU and wall time per stage of a checkpoint's tensors-file write (256 MiB, 1 MiB chunks).

``python bench/checkpoint_write_stages.py [variants] [rounds]``: the write loop of
``cudist.train._format._crc_through`` (``write(2)`` of each 1 MiB slice, then its CRC-32 through
``_format._crc32``), then fsync, into a new file in a temporary directory under the current one
(the disk checkpoints go to), two files kept as a manager keeps them. Variants, interleaved per
round: ``plain`` (as ``_format`` writes), ``dontneed`` (``posix_fadvise(DONTNEED)`` after fsync),
``sfr`` (``sync_file_range(WRITE)`` every 8 MiB, through libc: Linux only), ``native`` (one
``cudist._core.write_crc32`` call per 32 MiB tensor: the same write(2) + CRC-32 per 1 MiB without
the GIL; its time is reported as ``write``), ``direct`` (the same native call on an ``O_DIRECT``
descriptor, from 4096-aligned buffers: no page-cache copy; the optimistic bound, since checkpoint
tensors' addresses and file offsets are not aligned alike). Prints medians in ms.
"""
import ctypes
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from cudist.train import _format
crc32 = _format._crc32  # the very function the writer uses (native or zlib)
libc = ctypes.CDLL(None, use_errno=True)
libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
rng = np.random.default_rng(0)
arrs = [rng.standard_normal(8 << 20, dtype=np.float32) for _ in range(8)]
views = [memoryview(a.view(np.uint8)) for a in arrs]
CH = 1 << 20
def _aligned(a):
    raw = np.empty(a.nbytes + 4096, np.uint8)
    start = -raw.ctypes.data % 4096
    out = raw[start : start + a.nbytes]
    out[:] = a.view(np.uint8)
    return memoryview(out)
aligned = [_aligned(a) for a in arrs]
def one(d, variant):
    p = os.path.join(d, f"x{time.perf_counter_ns()}")
    direct = os.O_DIRECT if variant == "direct" else 0
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | direct, 0o644)
    tw = tc = cw = cc = 0.0
    off = 0
    t0 = time.perf_counter()
    if variant in ("native", "direct"):
        from cudist import _core
        for v in aligned if direct else views:
            a, ca = time.perf_counter(), time.thread_time()
            _core.write_crc32(fd, v, CH)
            tw += time.perf_counter() - a; cw += time.thread_time() - ca
    for v in views if variant not in ("native", "direct") else []:
        c = 0
        for s in range(0, len(v), CH):
            ch = v[s:s+CH]
            a, ca = time.perf_counter(), time.thread_time()
            os.write(fd, ch)
            b, cb = time.perf_counter(), time.thread_time()
            c = crc32(ch, c)
            e, ce = time.perf_counter(), time.thread_time()
            tw += b - a; cw += cb - ca; tc += e - b; cc += ce - cb
            off += len(ch)
            if variant == "sfr" and off % (8 * CH) == 0:
                libc.sync_file_range(fd, off - 8 * CH, 8 * CH, 2)
    a, ca = time.perf_counter(), time.thread_time()
    os.fsync(fd)
    if variant in ("dontneed", "sfr"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    tf, cf = time.perf_counter() - a, time.thread_time() - ca
    os.close(fd)
    return {"write": tw, "write cpu": cw, "crc": tc, "crc cpu": cc, "fsync": tf, "fsync cpu": cf, "total": time.perf_counter() - t0}, p
variants = sys.argv[1].split(",") if len(sys.argv) > 1 else ["plain", "dontneed", "sfr"]
R = int(sys.argv[2]) if len(sys.argv) > 2 else 5
res = {v: [] for v in variants}
with tempfile.TemporaryDirectory(dir=".") as d:
    keep = []
    for r in range(R + 1):
        for v in variants:
            m, p = one(d, v)
            keep.append(p)
            if len(keep) > 2:  # as a manager with max_to_keep=2
                os.remove(keep.pop(0))
            if r:
                res[v].append(m)
for v in variants:
    keys = res[v][0].keys()
    print(v, " ".join(f"{k}={statistics.median(x[k] for x in res[v])*1e3:.1f}" for k in keys))
