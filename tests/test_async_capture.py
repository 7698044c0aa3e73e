"""Asynchronous checkpoint saves that capture by copy-on-write snapshot (issue #29): the update pass
writes a variable whose snapshot a pending write holds out of place (the native table rules read
the held array and write a recycled one), so the save call copies nothing.

Checked here: the out-of-place kernels against the in-place ones bit for bit (every table rule,
dtypes, copy and gradient counts, odd sizes); training with asynchronous saves in between gives the
bits of training without them, on every CPU backend; each checkpoint holds the state of its save
call while the loop runs on; the recycled buffers stay two per tensor however many saves.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest

import cudist
from cudist import _settings, train
from cudist._kernels import UPDATE_KERNELS, cpu_backend, get_backend, reset_backend_cache
from cudist.train import _format

ASYNC = train.CheckpointOptions(enable_async=True)
#: The rules whose native kernels take ``sources=`` (the C++ rule table's, and momentum's).
TABLE = sorted(n for n in get_backend("native").trusted.out_of_place if not n.startswith("all_reduce_"))


def _hyper(name, dtype):
    """Scalars for a rule of the table (the weight decay last), plausible values."""
    scalars = UPDATE_KERNELS[name][1]
    values = {"lr": 0.01, "lr_t": 0.003, "beta_1": 0.9, "beta_2": 0.99, "epsilon": 1e-7, "c_m": 0.4,
              "c_g": 0.05, "c_v": 0.3, "decay": 0.002, "momentum": 0.9, "nesterov": True}
    return tuple(values[s] for s in scalars)


@pytest.mark.parametrize("name", TABLE)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("n,m,size", [(1, 1, 1), (1, 3, 4099), (3, 1, 1000), (2, 2, 300_007)])
def test_out_of_place_kernels_give_the_bits_of_in_place_ones(name, dtype, n, m, size):
    """``sources=``: the current values read from other arrays (read-only, as a held snapshot is),
    every copy written without being read (filled with garbage first): the in-place bits, and the
    sources untouched."""
    trusted = get_backend("native").trusted
    slots = UPDATE_KERNELS[name][0]
    rng = np.random.default_rng(hash((name, n, m, size)) % 2**32)
    w = rng.standard_normal(size).astype(dtype)
    state = [np.abs(rng.standard_normal(size)).astype(dtype) + dtype(0.1) for _ in slots]  # v, u, acc >= 0
    grads = [rng.standard_normal(size).astype(dtype) for _ in range(m)]
    hyper = _hyper(name, dtype)

    want_copies = tuple(w.copy() for _ in range(n))
    want_slots = [tuple(s.copy() for _ in range(n)) for s in state]
    fused = m > 1
    entry = f"all_reduce_{name}" if fused else name
    g = grads if fused else grads[0]
    getattr(trusted, entry)(want_copies, *want_slots, g, *hyper)

    sources = tuple(a.copy() for a in (w, *state))
    for s in sources:
        s.flags.writeable = False
    copies = tuple(np.full(size, np.nan, dtype) for _ in range(n))
    slot_copies = [tuple(np.full(size, np.nan, dtype) for _ in range(n)) for _ in state]
    getattr(trusted, entry)(copies, *slot_copies, g, *hyper, sources=sources)

    for got, want in zip([copies, *slot_copies], [want_copies, *want_slots]):
        for a, b in zip(got, want):
            assert a.tobytes() == b.tobytes()
    for s, a in zip(sources, (w, *state)):
        assert s.tobytes() == a.tobytes()


@pytest.mark.parametrize("name", ["adamw", "nadam", "lion"])
@pytest.mark.parametrize("offset", [0, 1])
def test_large_out_of_place_updates_stream_every_copy_with_the_same_bits(name, offset):
    """Past the streaming threshold (16 MiB written) copy 0 of an out-of-place update is streamed
    like the other copies; ``offset`` 1 starts the copies off a cache line (the head path)."""
    trusted = get_backend("native").trusted
    size = (1 << 21) + 13
    rng = np.random.default_rng(11)
    nslots = len(UPDATE_KERNELS[name][0])
    current = [rng.standard_normal(size).astype(np.float32) for _ in range(1 + nslots)]
    current[1:] = [np.abs(c) + np.float32(0.1) for c in current[1:]]
    grad = rng.standard_normal(size).astype(np.float32)
    hyper = _hyper(name, np.float32)
    want = [(c.copy(),) for c in current]
    getattr(trusted, name)(want[0], *want[1:], grad, *hyper)
    got = [(np.full(size + offset, np.nan, np.float32)[offset:],) for _ in current]
    getattr(trusted, name)(got[0], *got[1:], grad, *hyper, sources=tuple(current))
    for (a,), (b,) in zip(got, want):
        assert a.tobytes() == b.tobytes()


def test_out_of_place_kernels_reject_bad_sources():
    trusted = get_backend("native").trusted
    w, m, v, g = (np.ones(8, np.float32) for _ in range(4))
    good = (w.copy(), m.copy(), v.copy())
    with pytest.raises(ValueError, match="sources must hold 3 arrays"):
        trusted.adamw((w,), (m,), (v,), g, 0.1, 0.9, 0.99, 1e-7, 0.0, sources=good[:2])
    with pytest.raises(ValueError, match="source has 7 elements"):
        trusted.adamw((w,), (m,), (v,), g, 0.1, 0.9, 0.99, 1e-7, 0.0, sources=(good[0][:7], *good[1:]))
    with pytest.raises(TypeError, match="source has dtype float64"):
        trusted.adamw((w,), (m,), (v,), g, 0.1, 0.9, 0.99, 1e-7, 0.0, sources=(good[0].astype(np.float64), *good[1:]))
    with pytest.raises(ValueError, match="sources must hold 2 arrays"):
        trusted.momentum((w,), (m,), g, 0.1, 0.9, 0.0, sources=good)
    with pytest.raises(TypeError, match="source has dtype float64"):
        trusted.all_reduce_momentum((w,), (m,), (g, g), 0.1, 0.9, 0.0, sources=(good[0].astype(np.float64), good[1]))
    assert "momentum" in trusted.out_of_place and "all_reduce_momentum" in trusted.out_of_place
    assert "sgd" in trusted.out_of_place and "all_reduce_nesterov" in trusted.out_of_place  # every row of the table
    for name in ("numpy", "numba"):
        try:
            assert not get_backend(name).trusted.out_of_place
        except Exception as e:  # numba missing: nothing to check
            pytest.skip(f"{name}: {e}")


@pytest.fixture(params=["numpy", "numba", "native"])
def cpu_backend_named(request, monkeypatch):
    monkeypatch.setenv("CUDIST_BACKEND", request.param)
    reset_backend_cache()
    if cpu_backend().name != request.param:
        pytest.skip(f"backend {request.param} unavailable")  # pragma: no cover - the test extras install numba
    yield request.param
    monkeypatch.delenv("CUDIST_BACKEND", raising=False)
    reset_backend_cache()


OPTIMIZERS = {
    "adamw": lambda: cudist.optimizers.AdamW(0.01, weight_decay=0.01),
    "nadam": lambda: cudist.optimizers.Nadam(0.01),
    "lion": lambda: cudist.optimizers.Lion(0.001),
    "adagrad": lambda: cudist.optimizers.Adagrad(0.05),
    "momentum": lambda: cudist.optimizers.SGD(0.01, momentum=0.9),  # not (yet) a table rule: copied first
}


def _train(strategy, opt_name, dtype, saves, tmp_path, steps=7):
    """Runs ``steps`` steps; with ``saves``, an asynchronous save before every other step (held open
    while the next step runs). Returns the variables' and slots' bytes and the checkpoints written."""
    rng = np.random.default_rng(7)
    shapes = [(300_007,), (37, 91), (5,)]
    with strategy.scope():
        ws = [cudist.Variable(rng.standard_normal(s).astype(dtype), name=f"w{i}") for i, s in enumerate(shapes)]
        opt = OPTIMIZERS[opt_name]()
    grads = [[rng.standard_normal(s).astype(dtype) for s in shapes] for _ in range(steps)]

    def step(k):
        strategy.run(lambda: opt.apply_gradients(zip(grads[k], ws)))

    ckpt = train.Checkpoint(optimizer=opt, ws=ws)
    written = []
    for k in range(steps):
        if saves and k % 2 == 1:
            want = {i: (w.numpy().tobytes(), [opt.get_slot(w, s).numpy().tobytes() for s in opt._slot_names])
                    for i, w in enumerate(ws)}
            gate = threading.Event()
            _format.before_commit = lambda prefix, gate=gate: gate.wait(10)
            path = ckpt.save(str(tmp_path / "c"), options=ASYNC)
            step(k)  # runs while the write is held open
            gate.set()
            ckpt.sync()
            written.append((path, want))
        else:
            step(k)
    out = [w.numpy().tobytes() for w in ws]
    out += [opt.get_slot(w, s).numpy().tobytes() for w in ws for s in opt._slot_names]
    return out, written


def _tensors(path):
    from safetensors.numpy import load_file

    index = json.loads(Path(path + _format.INDEX_SUFFIX).read_text())
    return load_file(str(Path(path).parent / index["tensors"]))


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("where", ["default", "central-2cpu"])
def test_async_saves_in_between_leave_the_bits_of_training_without_them(
    cpu_backend_named, opt_name, where, tmp_path, monkeypatch
):
    """On every CPU backend: the variables and slots after 7 steps with 3 asynchronous saves in
    between (each held open across a step) are those of the same 7 steps without saves, and each
    checkpoint holds the state of its save call. CentralStorageStrategy over 2 CPU replicas takes
    the fused all-reduce + update pass."""
    monkeypatch.setattr(_format, "before_commit", _format.before_commit)  # _train replaces it
    dtype = np.float32

    def strategy():
        if where == "default":
            return cudist.get_strategy()
        return cudist.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])

    plain, _ = _train(strategy(), opt_name, dtype, False, tmp_path / "a")
    saved, written = _train(strategy(), opt_name, dtype, True, tmp_path / "b")
    assert saved == plain
    assert len(written) == 3
    for path, want in written:
        tensors = _tensors(path)
        for i, (w_bytes, slot_bytes) in want.items():
            assert tensors[f"ws/{i}"].tobytes() == w_bytes, f"{path}: ws/{i} is not the value of the save call"
            slots = sorted(k for k in tensors if k.startswith(f"ws/{i}/.OPTIMIZER_SLOT/"))
            assert len(slots) == len(slot_bytes)
    assert written[0][1] != written[1][1]


@pytest.mark.parametrize("between", [0, 1])
def test_the_native_backend_captures_without_a_copy_and_recycles_two_buffers(tmp_path, monkeypatch, between):
    """Native backend, a table rule: the save call copies nothing (the write reads the variables'
    snapshots, no staging buffer is kept), the next step writes elsewhere, and over 20 saves every
    variable and slot uses two buffers in turn: memory stays bounded (a save before every step, or
    with an in-place step between)."""
    monkeypatch.delenv("CUDIST_BACKEND", raising=False)
    reset_backend_cache()
    if cpu_backend().name != "native":
        pytest.skip("the native backend is not the CPU backend here")  # pragma: no cover
    rng = np.random.default_rng(3)
    w = cudist.Variable(rng.standard_normal(100_003).astype(np.float32), name="w")
    opt = cudist.optimizers.Nadam(0.01)
    g = rng.standard_normal(100_003).astype(np.float32)
    opt.apply_gradients([(g, w)])
    tensors = [w, opt.get_slot(w, "momentum"), opt.get_slot(w, "velocity")]
    ckpt = train.Checkpoint(optimizer=opt, w=w)
    manager = train.CheckpointManager(ckpt, str(tmp_path), max_to_keep=1)
    seen = [[] for _ in tensors]  # weak references to the distinct arrays each tensor's storage has been
    gate = threading.Event()
    monkeypatch.setattr(_format, "before_commit", lambda prefix: gate.wait(10))
    for k in range(20):
        gate.clear()
        before = [t.storage.array for t in tensors]
        values = [a.copy() for a in before]
        manager.save(options=ASYNC)
        assert all(t.storage.array is a for t, a in zip(tensors, before))  # the call moved nothing
        assert not ckpt._writer._staging  # private-read: no staging copy was made
        opt.apply_gradients([(g, w)])
        for t, a, v in zip(tensors, before, values):
            assert t.storage.array is not a  # written out of place ...
            assert a.tobytes() == v.tobytes()  # ... the held array keeps the saved value
        del before, a  # a buffer someone still holds is not recycled
        gate.set()
        manager.sync()
        for _ in range(between):  # no snapshot held now: in place
            opt.apply_gradients([(g, w)])
        for t, s in zip(tensors, seen):
            if not any(t.storage.array is r() for r in s):
                s.append(weakref.ref(t.storage.array))
    assert [len(s) for s in seen] == [2, 2, 2]
    assert all(r() is not None for s in seen for r in s)  # both still in use: one live, one kept
    restored = cudist.Variable(np.zeros(100_003, np.float32))
    train.Checkpoint(w=restored).restore(manager.latest_checkpoint).expect_partial()
    assert restored.numpy().tobytes() == values[0].tobytes()


def test_a_held_read_is_not_kept_as_a_recycled_buffer():
    """A user's ``read_value()`` held across a step: the table rule writes fresh memory out of place
    (no copy), the read keeps its value, and the storage keeps no second buffer for it."""
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal(4099).astype(np.float32)
    g = rng.standard_normal(4099).astype(np.float32)
    w, ref = cudist.Variable(w0), cudist.Variable(w0)
    opt, ref_opt = cudist.optimizers.AdamW(0.01), cudist.optimizers.AdamW(0.01)
    opt.apply_gradients([(g, w)])
    ref_opt.apply_gradients([(g, ref)])
    held = w.read_value()
    kept = held.copy()
    opt.apply_gradients([(g, w)])
    ref_opt.apply_gradients([(g, ref)])
    assert held.tobytes() == kept.tobytes()
    assert w.numpy().tobytes() == ref.numpy().tobytes()
    del held
    opt.apply_gradients([(g, w)])
    ref_opt.apply_gradients([(g, ref)])
    assert w.numpy().tobytes() == ref.numpy().tobytes()
    assert w.storage._retired is None and w.storage._spare is None  # private-read: nothing pooled


def test_an_exported_array_is_not_recycled(tmp_path, monkeypatch):
    """A DLPack export of the storage an out-of-place write moved away from keeps its memory: the
    storage does not write into it again while the export lives."""
    monkeypatch.delenv("CUDIST_BACKEND", raising=False)
    reset_backend_cache()
    if cpu_backend().name != "native":
        pytest.skip("the native backend is not the CPU backend here")  # pragma: no cover
    rng = np.random.default_rng(9)
    w = cudist.Variable(rng.standard_normal(5000).astype(np.float32))
    g = rng.standard_normal(5000).astype(np.float32)
    opt = cudist.optimizers.Lion(0.001)
    opt.apply_gradients([(g, w)])
    ckpt = train.Checkpoint(optimizer=opt, w=w)
    exported = np.from_dlpack(w)  # shares the live storage
    first = exported.copy()
    ckpt.write(str(tmp_path / "a"), options=ASYNC)
    opt.apply_gradients([(g, w)])  # out of place: the export keeps the saved value
    ckpt.sync()
    for k in range(4):  # later saves recycle buffers, never the exported one
        ckpt.write(str(tmp_path / f"b{k}"), options=ASYNC)
        opt.apply_gradients([(g, w)])
        ckpt.sync()
        assert exported.tobytes() == first.tobytes()
    del exported
    seen = []
    for k in range(4):  # with the export gone, two buffers take turns again
        ckpt.write(str(tmp_path / f"c{k}"), options=ASYNC)
        opt.apply_gradients([(g, w)])
        ckpt.sync()
        if not any(w.storage.array is r() for r in seen):
            seen.append(weakref.ref(w.storage.array))
    assert len(seen) == 2


def _nice(tid=0):
    return os.getpriority(os.PRIO_PROCESS, tid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
@pytest.mark.parametrize("setting,added", [(None, 0), ("0", 0), ("3", 3), ("10", 10), ("19", 19)])
def test_the_write_runs_at_a_lower_priority_in_its_own_thread_only(tmp_path, monkeypatch, setting, added):
    """CUDIST_CHECKPOINT_WRITER_NICE is added to the writer thread's niceness (capped at 19), seen from
    inside the write; the caller's thread, and a thread started after the save, keep theirs; the
    checkpoint is the same bytes as a synchronous save's."""
    if setting is None:
        monkeypatch.delenv(_settings.CHECKPOINT_WRITER_NICE, raising=False)
    else:
        monkeypatch.setenv(_settings.CHECKPOINT_WRITER_NICE, setting)
    base = _nice()
    seen = {}
    write = _format.write_checkpoint

    def spying_write(*args, **kwargs):
        seen["tid"] = threading.get_native_id()
        seen["nice"] = _nice(seen["tid"])
        write(*args, **kwargs)

    monkeypatch.setattr(_format, "write_checkpoint", spying_write)
    rng = np.random.default_rng(29)
    v = cudist.Variable(rng.standard_normal(1001).astype(np.float32))
    ckpt = train.Checkpoint(v=v)
    path = ckpt.write(str(tmp_path / "a"), options=ASYNC)
    ckpt.sync()
    assert seen["tid"] != threading.get_native_id()
    assert seen["nice"] == min(19, base + added)
    assert _nice() == base  # the caller's thread is untouched
    other = {}
    t = threading.Thread(target=lambda: other.setdefault("nice", _nice(threading.get_native_id())))
    t.start()
    t.join()
    assert other["nice"] == base  # so are the threads it starts later
    ckpt.write(str(tmp_path / "b"))
    data = sorted(tmp_path.glob("a.data-*"))[0].read_bytes()
    assert data == sorted(tmp_path.glob("b.data-*"))[0].read_bytes().replace(b"b.index.json", b"a.index.json")
    assert path == str(tmp_path / "a")


def test_a_bad_writer_priority_is_the_save_calls_error(tmp_path, monkeypatch):
    """Read in the caller's thread before the save changes anything: it raises, no write starts,
    ``save_counter`` is unchanged, and the next save works."""
    monkeypatch.setenv(_settings.CHECKPOINT_WRITER_NICE, "-5")
    v = cudist.Variable(np.arange(7, dtype=np.float32))
    ckpt = train.Checkpoint(v=v)
    manager = train.CheckpointManager(ckpt, str(tmp_path / "m"), max_to_keep=1)
    for save in (lambda: ckpt.write(str(tmp_path / "a"), options=ASYNC), lambda: ckpt.save(str(tmp_path / "s"), options=ASYNC),
                 lambda: manager.save(options=ASYNC)):
        with pytest.raises(ValueError, match="CUDIST_CHECKPOINT_WRITER_NICE"):
            save()
    assert int(ckpt.save_counter) == 0
    assert [p.name for p in tmp_path.iterdir()] in ([], ["m"]) and not list((tmp_path / "m").glob("*"))
    monkeypatch.setenv(_settings.CHECKPOINT_WRITER_NICE, "1")
    ckpt.write(str(tmp_path / "a"), options=ASYNC)
    ckpt.sync()
    restored = cudist.Variable(np.zeros(7, np.float32))
    train.Checkpoint(v=restored).read(str(tmp_path / "a"))
    assert np.array_equal(restored.numpy(), v.numpy())


@pytest.mark.parametrize("extra", [[], ["--every", "2", "--saves", "2"], ["--every", "2", "--saves", "2", "--ab"]])
def test_the_benchmark_runs_both_modes(extra):
    """bench/async_checkpoint.py: the steps-after-a-save mode and the save-every-K-steps mode print
    their tables (1 MiB, so it is quick)."""
    import subprocess  # noqa: PLC0415 - only this test starts a process

    script = Path(__file__).resolve().parents[1] / "bench" / "async_checkpoint.py"
    out = subprocess.run(
        [sys.executable, str(script), "1", "2", "2", "momentum", *extra],
        capture_output=True, text=True, timeout=300, check=True,
        env={k: v for k, v in os.environ.items() if k != _settings.CHECKPOINT_WRITER_NICE},
    ).stdout
    if "--ab" in extra:  # the writers A/B: each way's row, its background thread's CPU last
        assert "2 rounds of 2 x (save, 2 steps)" in out and "sync direct save call" in out
        rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| writer")]
        assert [r.split(" | ")[0] for r in rows] == ["| async", "| async direct", "| async python", "| memcpy", "| spin"]
        assert all(len(r.split(" | ")) == 7 and "nan" not in r for r in rows)
    elif extra:
        assert "2 rounds of 2 x (save, 2 steps)" in out
        rows = [line for line in out.splitlines() if line.startswith("| async nice ")]
        assert [r.split(" | ")[0] for r in rows] == ["| async nice 0", "| async nice 10"]
        assert all(len(r.split(" | ")) == 7 for r in rows)
    else:
        assert "2 steps after each async save" in out and out.count("\n|") == 3
