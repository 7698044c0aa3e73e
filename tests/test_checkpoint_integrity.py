"""Checkpoint integrity (issue 26): nothing lost, nothing silently wrong, nothing hanging.

A damaged checkpoint is one error, :class:`cudist.errors.DataLossError` (also a ValueError), naming
the file and the problem, raised before anything is assigned; a fuzz test flips and truncates every
byte of a small checkpoint. Paths in a checkpoint or state file stay in its directory; managers
delete only their own name's checkpoints; racing writers and failed saves leave the last good
checkpoint and no debris.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import cudist
from cudist.errors import DataLossError
from cudist.train import _format

train = cudist.train


# ================================================================================ helpers
class Model:
    """Variables as attributes (a user's model)."""


SAVED = {"v": np.array([1.5, -2.0, 3.0, 4.0], np.float32), "c": np.int64(7)}


def _trained():
    """A model (a float32 vector, an int64 scalar) and an SGD momentum optimizer after one step."""
    m = Model()
    m.v = cudist.Variable(SAVED["v"], name="v")
    m.c = cudist.Variable(SAVED["c"], name="c")
    opt = cudist.optimizers.SGD(0.1, momentum=0.9)
    opt.apply_gradients([(np.ones(4, np.float32), m.v)])
    m.v.assign(SAVED["v"])
    return m, opt


def _snapshot(m, opt):
    return {
        "v": m.v.numpy().tobytes(),
        "c": m.c.numpy().tobytes(),
        "momentum": opt.get_slot(m.v, "momentum").numpy().tobytes(),
        "iterations": opt.iterations.numpy().tobytes(),
        "lr": opt.learning_rate,
    }


def _scramble(m, opt):
    """Values that differ from the saved ones everywhere, to see what a restore touched."""
    m.v.assign(np.full(4, 9.0, np.float32))
    m.c.assign(99)
    opt.get_slot(m.v, "momentum").assign(np.full(4, 5.0, np.float32))
    opt.iterations.assign(42)
    opt.learning_rate = 0.5


def _files(prefix: str) -> tuple[Path, Path]:
    index = Path(prefix + ".index.json")
    return index, index.parent / json.loads(index.read_text())["tensors"]


def _rewrite_index(prefix: str, mutate) -> None:
    """Rewrites an index through ``mutate(dict)`` with a matching checksum (a crafted index)."""
    index, _ = _files(prefix)
    obj = json.loads(index.read_text())
    mutate(obj)
    obj["crc32"] = _format._index_crc(obj)
    index.write_text(json.dumps(obj))


def _split_tensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join_tensors(path: Path, header: dict, data: bytes, length: int | None = None) -> None:
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head) if length is None else length) + head + data)


def _rewrite_header(prefix: str, mutate) -> None:
    _, tensors = _files(prefix)
    header, data = _split_tensors(tensors)
    mutate(header)
    _join_tensors(tensors, header, data)


def _in_thread(fn, timeout: float = 20.0):
    """Runs ``fn`` in a thread; returns ("ok", value), ("raised", exc) or ("blocked", None)."""
    out: list = []

    def run():
        try:
            out.append(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out.append(("raised", e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return out[0] if out else ("blocked", None)


def _unblock(fifo: Path) -> None:
    """Opens a FIFO for writing (O_RDWR does not block on Linux) and closes it: a reader blocked in open() returns."""
    os.close(os.open(fifo, os.O_RDWR))


# ================================================================================ the fuzz test
def _fuzz_objects(strategy):
    """A mirrored model with a sync-on-read SUM total (components 1, 2), an SGD momentum optimizer."""
    with strategy.scope():
        m, opt = _trained()
        m.total = cudist.Variable(np.float32(0), synchronization=cudist.VariableSynchronization.ON_READ,
                                  aggregation=cudist.VariableAggregation.SUM)
    strategy.run(lambda: m.total.assign_add(np.float32(cudist.get_replica_context().replica_id_in_sync_group + 1)))
    return m, opt


def test_every_byte_flipped_or_truncated_restores_exactly_or_raises_data_loss(tmp_path):
    strategy = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    m, opt = _fuzz_objects(strategy)
    source = train.Checkpoint(model=m, optimizer=opt)
    prefix = source.save(str(tmp_path / "fz"))

    def snapshot(m, opt, ckpt):
        return {**_snapshot(m, opt), "total": [c.numpy().tobytes() for c in m.total.values],
                "save_counter": int(ckpt.save_counter)}

    saved = snapshot(m, opt, source)
    index, tensors = _files(prefix)
    originals = {index: index.read_bytes(), tensors: tensors.read_bytes()}
    (header_len,) = struct.unpack("<Q", originals[tensors][:8])
    data_start = 8 + header_len

    tm, topt = _fuzz_objects(strategy)
    target = train.Checkpoint(model=tm, optimizer=topt)

    def scramble():
        _scramble(tm, topt)
        strategy.run(lambda: tm.total.assign(np.float32(30.0)))
        target.save_counter.assign(77)

    scramble()
    untouched = snapshot(tm, topt, target)
    outcomes: dict[str, dict[str, int]] = {}

    def put(path: Path, data: bytes) -> None:
        # In place, not write_bytes: ext4 flushes a file truncated to 0 and rewritten when it is closed.
        with open(path, "r+b") as f:
            f.write(data)
            f.truncate()

    def attempt(region: str, path: Path, mutated: bytes) -> None:
        put(path, mutated)
        try:
            target.restore(prefix).assert_consumed()
        except DataLossError as e:
            assert str(path) in str(e), f"{region}: the error does not name {path}: {e}"
            assert snapshot(tm, topt, target) == untouched, f"{region}: a failed restore changed the variables ({e})"
            outcomes.setdefault(region, {}).setdefault("error", 0)
            outcomes[region]["error"] += 1
        else:
            assert snapshot(tm, topt, target) == saved, f"{region}: restored, but not the saved values"
            outcomes.setdefault(region, {}).setdefault("exact", 0)
            outcomes[region]["exact"] += 1
            scramble()
        finally:
            put(path, originals[path])

    def region_of(path: Path, i: int) -> str:
        if path == index:
            return "index"
        return "length" if i < 8 else "header" if i < data_start else "data"

    for path, raw in originals.items():
        for i in range(len(raw)):
            flipped = bytearray(raw)
            flipped[i] ^= 1 << (i % 8)  # every byte, each bit position in turn
            attempt(region_of(path, i), path, bytes(flipped))
            attempt(region_of(path, i) + " truncated", path, raw[:i])
    # Every flip of the data and the length is caught (the checksums, the exact tiling).
    assert set(outcomes["data"]) == {"error"} and set(outcomes["length"]) == {"error"}, outcomes
    assert set(outcomes["header"]) == {"error"}, outcomes
    assert set(outcomes["data truncated"]) == {"error"} and set(outcomes["header truncated"]) == {"error"}, outcomes
    assert outcomes["index"]["error"] > 0.95 * len(originals[index]), outcomes


# ================================================================================ hangs and resources
def test_a_fifo_in_place_of_a_checkpoint_file_raises_instead_of_blocking(tmp_path):
    m, opt = _trained()
    ckpt = train.Checkpoint(model=m, optimizer=opt)
    manager = train.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    prefix = manager.save()
    index, tensors = _files(prefix)
    for victim in (tensors, index):
        content = victim.read_bytes()
        victim.unlink()
        os.mkfifo(victim)
        try:
            kind, value = _in_thread(lambda: train.Checkpoint(model=_trained()[0]).read(prefix))
            if kind == "blocked":
                _unblock(victim)
            assert kind == "raised" and isinstance(value, DataLossError), (kind, value)
            assert str(victim) in str(value) and "not a regular file" in str(value)
        finally:
            victim.unlink()
            victim.write_bytes(content)
    state = tmp_path / "checkpoint"
    state.unlink()
    os.mkfifo(state)
    try:
        kind, value = _in_thread(lambda: (train.latest_checkpoint(tmp_path), train.CheckpointManager(ckpt, tmp_path).latest_checkpoint))
        if kind == "blocked":
            _unblock(state)
        assert (kind, value) == ("ok", (None, None))
    finally:
        state.unlink()


def test_oversized_claims_are_refused_before_reading_or_allocating(tmp_path):
    m, opt = _trained()
    prefix = train.Checkpoint(model=m, optimizer=opt).write(str(tmp_path / "big"))
    index, tensors = _files(prefix)
    original = tensors.read_bytes()
    # A 256 MiB header claimed by a (sparse) 300 MiB file: refused by its length alone.
    with open(tensors, "r+b") as f:
        f.write(struct.pack("<Q", 256 << 20))
        f.truncate(300 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(DataLossError, match=r"header length 268435456 is over the 100000000-byte limit"):
            train.Checkpoint(model=_trained()[0]).read(prefix)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes allocated"
    # A save_counter or a variable claiming 2**40 elements (index and header agreeing, the index's
    # checksum fixed) over 8 / 16 bytes.
    tensors.write_bytes(original)
    ckpt = train.Checkpoint(model=m, optimizer=opt)
    prefix = ckpt.save(str(tmp_path / "counted"))
    _rewrite_index(prefix, lambda ix: ix["objects"]["save_counter"].update(shape=[2**40]))
    _rewrite_header(prefix, lambda h: h["save_counter"].update(shape=[2**40]))
    with pytest.raises(DataLossError, match="save_counter is not a scalar int64 variable"):
        train.Checkpoint(model=_trained()[0]).read(prefix)
    prefix = ckpt.save(str(tmp_path / "counted"))
    _rewrite_index(prefix, lambda ix: ix["objects"]["model/v"].update(shape=[2**40]))
    _rewrite_header(prefix, lambda h: h["model/v"].update(shape=[2**40]))
    with pytest.raises(DataLossError, match="'model/v' spans 16 bytes; its dtype and shape make 4398046511104"):
        train.Checkpoint(model=_trained()[0]).read(prefix)
    # An oversized index or state file is refused by its size.
    big = tmp_path / "huge"
    big.mkdir()
    (big / "checkpoint").write_bytes(b" " * (_format.MAX_JSON_BYTES + 1))
    assert train.latest_checkpoint(big) is None


# ================================================================================ silently wrong
def test_flipped_data_and_negative_offsets_are_data_loss(tmp_path):
    m, opt = _trained()
    prefix = train.Checkpoint(model=m, optimizer=opt).write(str(tmp_path / "x"))
    _, tensors = _files(prefix)
    raw = bytearray(tensors.read_bytes())
    raw[-3] ^= 0x10  # in the last tensor's data
    tensors.write_bytes(bytes(raw))
    tm, topt = _trained()
    _scramble(tm, topt)
    before = _snapshot(tm, topt)
    with pytest.raises(DataLossError, match=r"is corrupt: its data sums to [0-9a-f]{8}, the header records") as e:
        train.Checkpoint(model=tm, optimizer=topt).read(prefix)
    assert str(tensors) in str(e.value) and _snapshot(tm, topt) == before

    prefix = train.Checkpoint(model=m, optimizer=opt).write(str(tmp_path / "neg"))

    def negative(h):  # the int64 counter read from 8 bytes before the data: the header's own bytes
        begin, end = h["model/c"]["data_offsets"]
        h["model/c"]["data_offsets"] = [-8, 0]

    _rewrite_header(prefix, negative)
    with pytest.raises(DataLossError, match=r"'model/c' has data_offsets \[-8, 0\]"):
        train.Checkpoint(model=tm, optimizer=topt).read(prefix)
    assert _snapshot(tm, topt) == before


@pytest.mark.parametrize("where, mutate, message", [
    ("index", lambda ix: ix.update(objects=[]), "has no objects"),
    ("index", lambda ix: ix["objects"]["model/v"].update(kind="tensor"), "has kind 'tensor'"),
    ("index", lambda ix: ix["objects"]["model/v"].update(shape=["4"]), r"has shape \['4'\]"),
    ("index", lambda ix: ix["objects"]["model/v"].update(shape=[-4]), r"has shape \[-4\]"),
    ("index", lambda ix: ix["objects"]["model/v"].update(shape=["x"] * 100_000), r"has shape \['x', 'x', .*\.\.\.$"),
    ("index", lambda ix: ix["objects"]["model/v"].update(dtype="float99"), "has dtype 'float99'"),
    ("index", lambda ix: ix["objects"]["model/v"].update(per_replica=5), "has per_replica 5"),
    ("index", lambda ix: ix["objects"]["model/v"].pop("tensor"), "names no tensor"),
    ("index", lambda ix: ix["objects"]["model/v"].update(tensor="model/w"), "names tensor 'model/w', which the file lacks"),
    ("index", lambda ix: ix["objects"]["model/v"].update(shape=[2, 2]), r"is F32\[4\] here but float32\[2, 2\]"),
    ("index", lambda ix: ix["objects"].update({"model/v": None}), "is not a record"),
    ("index", lambda ix: ix["objects"]["optimizer"].update(hyperparameters=[]), "has no hyperparameters"),
    ("index", lambda ix: ix["objects"]["optimizer"].update(slots={"model/v": 3}), "has slots"),
    ("index", lambda ix: ix.update(tensors=None), "names the tensors file None"),
    ("index", lambda ix: ix.update(version="2"), "checkpoint format version '2'"),
    ("index", lambda ix: ix.update(version=3), "checkpoint format version 3"),
    ("index", lambda ix: ix.update(save_counter=[1]), r"save_counter is \[1\]"),
    ("index", lambda ix: ix.update(format="other"), "not a cudist checkpoint index"),
    ("header", lambda h: h.update({"model/v": []}), "'model/v' has a malformed header entry"),
    ("header", lambda h: h["model/v"].pop("dtype"), "'model/v' has a malformed header entry"),
    ("header", lambda h: h["model/v"].update(dtype="F33"), "'model/v' has a malformed header entry"),
    ("header", lambda h: h["model/v"].update(data_offsets=[0]), r"'model/v' has data_offsets \[0\]"),
    ("header", lambda h: h["model/v"].update(data_offsets=["0", "16"]), "'model/v' has data_offsets"),
    ("header", lambda h: h.update(__metadata__=[]), "__metadata__ is not a map of strings"),
    ("header", lambda h: h["__metadata__"].update(index="other.index.json"), "header's index is 'other.index.json'"),
    ("header", lambda h: h["__metadata__"].pop("version"), "header's version is None, not '2'"),
    ("header", lambda h: h["__metadata__"].update({"crc32:model/v": "xyz"}), "malformed checksum 'xyz'"),
    ("header", lambda h: h["__metadata__"].pop("crc32:model/v"), "'model/v' has no checksum"),
])
def test_malformed_index_or_header_is_data_loss_naming_the_file(tmp_path, where, mutate, message):
    m, opt = _trained()
    prefix = train.Checkpoint(model=m, optimizer=opt).write(str(tmp_path / "x"))
    index, tensors = _files(prefix)
    (_rewrite_index if where == "index" else _rewrite_header)(prefix, mutate)
    tm, topt = _trained()
    _scramble(tm, topt)
    before = _snapshot(tm, topt)
    with pytest.raises(DataLossError, match=message) as e:
        train.Checkpoint(model=tm, optimizer=topt).read(prefix)
    # The file named: the one changed, or the tensors file where the two disagree.
    assert str(index if where == "index" else tensors) in str(e.value) or "the file lacks" in message or "here but" in message
    assert _snapshot(tm, topt) == before
    assert isinstance(e.value, ValueError) and e.value.error_code == cudist.errors.DATA_LOSS
    assert len(str(e.value)) <= 1000  # a crafted megabyte of shape is not repeated in full


def test_an_index_edited_without_its_checksum_is_data_loss(tmp_path):
    m, opt = _trained()
    prefix = train.Checkpoint(model=m, optimizer=opt).write(str(tmp_path / "x"))
    index, _ = _files(prefix)
    obj = json.loads(index.read_text())
    obj["objects"]["optimizer"]["hyperparameters"]["learning_rate"] = 0.2
    index.write_text(json.dumps(obj))
    with pytest.raises(DataLossError, match="checksum mismatch: the index records"):
        train.Checkpoint(model=m, optimizer=opt).read(prefix)


def test_version_1_checkpoints_without_checksums_still_restore(tmp_path):
    m, opt = _trained()
    prefix = train.Checkpoint(model=m, optimizer=opt).write(str(tmp_path / "old"))
    index, tensors = _files(prefix)
    header, data = _split_tensors(tensors)
    header["__metadata__"] = {"format": "cudist-checkpoint", "version": "1", "index": "old.index.json"}
    _join_tensors(tensors, header, data)
    obj = json.loads(index.read_text())
    obj["version"] = 1
    del obj["crc32"]
    index.write_text(json.dumps(obj))
    tm, topt = _trained()
    _scramble(tm, topt)
    train.Checkpoint(model=tm, optimizer=topt).read(prefix).assert_consumed()
    assert _snapshot(tm, topt) == _snapshot(m, opt)


def test_checksums_are_safetensors_metadata(tmp_path):
    st = pytest.importorskip("safetensors")
    m, opt = _trained()
    prefix = train.Checkpoint(model=m, optimizer=opt).write(str(tmp_path / "x"))
    _, tensors = _files(prefix)
    with st.safe_open(str(tensors), "numpy") as f:
        meta = f.metadata()
        assert meta["version"] == "2"
        for key in f.keys():
            assert meta[f"crc32:{key}"] == f"{__import__('zlib').crc32(f.get_tensor(key).tobytes()):08x}"


# ================================================================================ all or nothing
def _dist_iter(strategy, n=40):
    ds = cudist.data.Dataset.from_tensor_slices(np.arange(n, dtype=np.float32)).batch(2)
    return iter(strategy.experimental_distribute_dataset(ds))


def test_restore_checks_everything_before_it_assigns_anything(tmp_path):
    strategy = cudist.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        m, opt = _trained()
    it = _dist_iter(strategy)
    for _ in range(5):
        next(it)
    prefix = train.Checkpoint(model=m, optimizer=opt, iterator=it).write(str(tmp_path / "x"))

    with strategy.scope():
        tm, topt = _trained()
    _scramble(tm, topt)
    before = _snapshot(tm, topt)
    # An iterator position past a shorter input: nothing restored, the iterator where it was.
    short = _dist_iter(strategy, n=6)
    next(short)
    with pytest.raises(ValueError, match="ends after 3 steps"):
        train.Checkpoint(model=tm, optimizer=topt, iterator=short).read(prefix)
    assert _snapshot(tm, topt) == before
    assert float(np.asarray(next(short)).ravel()[0]) == 2.0
    # A NaN learning rate (the index's checksum fixed): nothing restored.
    _rewrite_index(prefix, lambda ix: ix["objects"]["optimizer"]["hyperparameters"].update(learning_rate=float("nan")))
    with pytest.raises(DataLossError, match="has learning rate nan"):
        train.Checkpoint(model=tm, optimizer=topt, iterator=_dist_iter(strategy)).read(prefix)
    assert _snapshot(tm, topt) == before
    # A fresh optimizer gets no slots from a checkpoint whose data is corrupt.
    prefix = train.Checkpoint(model=m, optimizer=opt).write(str(tmp_path / "y"))
    _, tensors = _files(prefix)
    raw = bytearray(tensors.read_bytes())
    raw[-1] ^= 1
    tensors.write_bytes(bytes(raw))
    fresh = cudist.optimizers.SGD(0.1, momentum=0.9)
    with pytest.raises(DataLossError):
        train.Checkpoint(model=tm, optimizer=fresh).read(prefix)
    assert len(fresh.variables) == 2  # iterations and learning_rate only
    with pytest.raises(KeyError, match="has no slots"):
        fresh.get_slot(tm.v, "momentum")


# ================================================================================ paths and managers
def test_paths_in_state_files_and_indexes_stay_in_their_directory(tmp_path, caplog):
    victim = tmp_path / "victim"
    vm, vopt = _trained()
    vprefix = train.CheckpointManager(train.Checkpoint(model=vm), victim).save()
    victim_files = sorted(os.listdir(victim))
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint").write_text(json.dumps({
        "model_checkpoint_path": "../victim/ckpt-1",
        "all_model_checkpoint_paths": ["../victim/ckpt-1", vprefix, str(victim / "ckpt-1"), "ckpt-1"],
    }))
    with caplog.at_level(logging.WARNING, logger="cudist"):
        assert train.latest_checkpoint(run) is None
        manager = train.CheckpointManager(train.Checkpoint(model=_trained()[0]), run, max_to_keep=1)
        assert manager.latest_checkpoint == str(run / "ckpt-1")  # named in the directory (it does not exist)
        for _ in range(3):
            manager.save()
    assert "not a checkpoint in that directory" in caplog.text
    assert sorted(os.listdir(victim)) == victim_files  # nothing outside `run` deleted
    train.Checkpoint(model=_trained()[0]).restore(vprefix).assert_consumed()
    assert manager.checkpoints == [str(run / "ckpt-3")]
    # An index naming a tensors file elsewhere (its checksum fixed).
    _, vtensors = _files(vprefix)
    for elsewhere in ("../victim/" + vtensors.name, str(vtensors), "ckpt-3.data-00000000.safetensors/../x"):
        _rewrite_index(manager.latest_checkpoint, lambda ix, e=elsewhere: ix.update(tensors=e))
        with pytest.raises(DataLossError, match="names the tensors file"):
            train.Checkpoint(model=_trained()[0]).read(manager.latest_checkpoint)
    with pytest.raises(ValueError, match="must be a file name"):
        train.CheckpointManager(train.Checkpoint(model=vm), run, checkpoint_name="../victim/ckpt")


def test_managers_of_different_names_share_a_directory(tmp_path):
    model, ema = _trained()[0], _trained()[0]
    a = train.CheckpointManager(train.Checkpoint(model=model), tmp_path, max_to_keep=1, checkpoint_name="model")
    b = train.CheckpointManager(train.Checkpoint(model=ema), tmp_path, max_to_keep=1, checkpoint_name="ema")
    for _ in range(2):
        a.save()
        b.save()
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".index.json")) == ["ema-2.index.json", "model-2.index.json"]
    assert (a.checkpoints, b.checkpoints) == ([str(tmp_path / "model-2")], [str(tmp_path / "ema-2")])
    assert train.latest_checkpoint(tmp_path) == str(tmp_path / "ema-2")  # the newest of the directory (TF)
    # Restarted: each finds its own.
    a2 = train.CheckpointManager(train.Checkpoint(model=model), tmp_path, max_to_keep=1, checkpoint_name="model")
    b2 = train.CheckpointManager(train.Checkpoint(model=ema), tmp_path, max_to_keep=1, checkpoint_name="ema")
    assert (a2.latest_checkpoint, a2.checkpoints) == (str(tmp_path / "model-2"), [str(tmp_path / "model-2")])
    assert (b2.latest_checkpoint, b2.checkpoints) == (str(tmp_path / "ema-2"), [str(tmp_path / "ema-2")])
    assert a2.restore_or_initialize() == str(tmp_path / "model-2")  # save_counter 2: the next is model-3
    a2.save()
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".index.json")) == ["ema-2.index.json", "model-3.index.json"]
    # A plain Checkpoint.save in the same directory keeps the managers' entries listed.
    train.Checkpoint(model=model).save(str(tmp_path / "manual"))
    state = json.loads((tmp_path / "checkpoint").read_text())
    assert state["model_checkpoint_path"] == "manual-1"
    assert state["all_model_checkpoint_paths"] == ["ema-2", "model-3", "manual-1"]


def test_racing_writers_of_one_prefix_leave_one_complete_checkpoint(tmp_path, monkeypatch):
    first, second = _trained()[0], _trained()[0]
    second.v.assign(np.full(4, 2.0, np.float32))
    prefix = str(tmp_path / "same")
    nested = []

    def interleave(p):  # the second writer runs a whole write while the first is about to commit
        if not nested:
            nested.append(p)
            train.Checkpoint(model=second).write(prefix)

    monkeypatch.setattr(_format, "before_commit", interleave)
    train.Checkpoint(model=first).write(prefix)
    monkeypatch.undo()
    target = _trained()[0]
    train.Checkpoint(model=target).read(prefix).assert_consumed()
    assert target.v.numpy().tolist() == SAVED["v"].tolist()  # the first writer committed last
    assert len(list(tmp_path.glob("same.data-*.safetensors"))) == 1 and not list(tmp_path.glob(".*"))


RACER = """
import sys, numpy as np, cudist
v = cudist.Variable(np.zeros(1000, np.float32))
ckpt = cudist.train.Checkpoint(v=v)
for i in range(int(sys.argv[3])):
    v.assign(np.full(1000, float(sys.argv[2]) * 1000 + i, np.float32))
    ckpt.write(sys.argv[1])
"""


def test_racing_processes_of_one_prefix_leave_one_complete_checkpoint(tmp_path):
    prefix = str(tmp_path / "raced")
    procs = [subprocess.Popen([sys.executable, "-c", RACER, prefix, str(k), "25"]) for k in (1, 2)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    v = cudist.Variable(np.zeros(1000, np.float32))
    train.Checkpoint(v=v).read(prefix).assert_consumed()
    value = v.numpy()
    assert (value == value[0]).all() and value[0] in {1024.0, 2024.0}
    assert len(list(tmp_path.glob("raced.data-*.safetensors"))) == 1 and not list(tmp_path.glob(".*"))


def test_a_save_that_fails_leaves_no_debris_and_later_saves_succeed(tmp_path, monkeypatch):
    m, opt = _trained()
    manager = train.CheckpointManager(train.Checkpoint(model=m, optimizer=opt), tmp_path, max_to_keep=2)
    manager.save()
    before = sorted(os.listdir(tmp_path))
    real = _format.atomic_write_json

    def full_disk(path, obj):
        if path.endswith(_format.INDEX_SUFFIX):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real(path, obj)

    monkeypatch.setattr(_format, "atomic_write_json", full_disk)
    for _ in range(3):
        with pytest.raises(OSError, match="No space left"):
            manager.save()
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == before  # the complete tensors files removed, not orphaned
    # Debris of crashed saves of this manager's name goes with its next save; another name's, and a
    # file a live writer holds, stay.
    crashed = ["ckpt-7.data-0123abcd.safetensors", ".ckpt-8.data-89abcdef.safetensors.01234567.tmp",
               ".ckpt-8.index.json.76543210.tmp"]
    kept = ["other-7.data-0123abcd.safetensors", "ckpt-9.data-00000000.safetensors"]
    for name in crashed + kept:
        (tmp_path / name).write_bytes(b"x")
    fcntl = pytest.importorskip("fcntl")  # POSIX: where writers hold their files with flock
    held = os.open(tmp_path / kept[1], os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        path = manager.save()
    finally:
        os.close(held)
    names = set(os.listdir(tmp_path))
    assert not names & set(crashed) and set(kept) <= names
    train.Checkpoint(model=_trained()[0], optimizer=cudist.optimizers.SGD(0.1, momentum=0.9)).restore(path).assert_consumed()


def test_an_unreadable_state_file_is_logged_and_ignored(tmp_path, caplog):
    (tmp_path / "checkpoint").write_text("model_checkpoint_path: 'ckpt-1'  # TF's text format, or garbage")
    with caplog.at_level(logging.WARNING, logger="cudist"):
        assert train.latest_checkpoint(tmp_path) is None
    assert str(tmp_path / "checkpoint") in caplog.text and "is not valid JSON" in caplog.text


def test_native_crc32_is_zlibs_and_either_reads_the_others_files(tmp_path, monkeypatch):
    import zlib

    core = pytest.importorskip("cudist._core")
    rng = np.random.default_rng(3)
    for n in [*range(200), 1000, 4095, 65536 + 7, (1 << 20) + 13]:
        data = rng.bytes(n)
        for seed in (0, 0xFFFFFFFF, 0x1234567):
            assert core.crc32(data, seed) == zlib.crc32(data, seed), (n, seed)
            assert core.crc32(memoryview(data)[3:], seed) == zlib.crc32(memoryview(data)[3:], seed), (n, seed)
    m, opt = _trained()
    big = Model()
    big.w = cudist.Variable(rng.standard_normal(300_000).astype(np.float32))  # over one 1 MiB chunk
    native = train.Checkpoint(model=m, optimizer=opt, big=big).write(str(tmp_path / "native"))
    monkeypatch.setattr(_format, "_crc32", zlib.crc32)
    monkeypatch.setattr(_format, "_write_crc32", None)  # the Python loop with zlib's CRC-32, not _core.write_crc32
    written_by_zlib = train.Checkpoint(model=m, optimizer=opt, big=big).write(str(tmp_path / "zlib"))
    assert _files(native)[1].read_bytes()[:100] != b"" and (
        _split_tensors(_files(native)[1])[0]["__metadata__"] == _split_tensors(_files(written_by_zlib)[1])[0]["__metadata__"]
        | {"index": "native.index.json"}
    )
    target = Model()
    target.w = cudist.Variable(np.zeros(300_000, np.float32))
    train.Checkpoint(model=_trained()[0], optimizer=cudist.optimizers.SGD(0.1, momentum=0.9), big=target).read(native).assert_consumed()
    np.testing.assert_array_equal(target.w.numpy(), big.w.numpy())
