"""cudist.train: Checkpoint, CheckpointManager, latest_checkpoint.

TensorFlow 2.21 is the reference for the API's behaviour; what it does was recorded in its venv and
is quoted next to the tests that check it. The kill tests run this file as a training script
(``python tests/test_checkpoint.py train ...``) in a subprocess, SIGKILL it (at a random step, and
in the middle of a save), restart it from ``latest_checkpoint`` and compare its final state bit
for bit with an uninterrupted run.
"""

from __future__ import annotations

import copy
import functools
import glob
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import cudist
from cudist import VariableAggregation as Agg
from cudist import VariableSynchronization as Sync

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
from conftest import make_strategy, set_gpu0_split  # noqa: E402

train = cudist.train
ON_READ = Sync.ON_READ


def _bits(a) -> bytes:
    a = np.asarray(a)
    return a.dtype.str.encode() + str(a.shape).encode() + a.tobytes()


def _components(v):
    return [np.asarray(c.numpy()) for c in v.values] if isinstance(v, cudist.DistributedValues) else [np.asarray(v.numpy())]


def _assert_same(a, b, what=""):
    assert _bits(a) == _bits(b), f"{what}: {a!r} != {b!r}"


class Model:
    """A user's model class: variables as attributes, a nested layer, a list of them."""


# ================================================================================ round trips
DTYPES = [np.float32, np.float16, np.float64, np.int32, np.int64, np.complex128]
# GPU kinds (CuPy arrays; run under the CuPy emulation too): the GPU kernels lack complex128, which
# a sync-on-read variable's aggregate read needs.
ROUND_TRIPS = [
    *[pytest.param(k, d, id=f"{np.dtype(d).name}-{k}") for k in ("one_device", "mirrored2", "mirrored3", "central2")
      for d in DTYPES],
    *[pytest.param(k, d, id=f"{np.dtype(d).name}-{k}", marks=pytest.mark.gpu) for k in ("mirrored_gpu3", "central_gpu2")
      for d in DTYPES if d is not np.complex128],
]


def _make_vars(strategy, dtype, seed):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)

    def value(shape):
        a = rng.integers(-50, 50, size=shape)
        if dtype.kind == "c":
            return (a + 1j * rng.integers(-5, 5, size=shape)).astype(dtype)
        return (a / 4 if dtype.kind == "f" else a).astype(dtype)

    with strategy.scope():
        m = Model()
        m.w = cudist.Variable(value((3, 4)), name="w")
        m.scalar = cudist.Variable(value(()), name="s")
        m.summed = cudist.Variable(value((2,)), aggregation=Agg.SUM, name="summed")
        m.frozen = cudist.Variable(value((5,)), trainable=False, name="frozen")
        m.total = cudist.Variable(value((2,)), synchronization=ON_READ, aggregation=Agg.SUM, name="total")
        m.first = cudist.Variable(value(()), synchronization=ON_READ, aggregation=Agg.ONLY_FIRST_REPLICA)
        if dtype.kind in "fc":
            m.mean = cudist.Variable(value((2,)), synchronization=ON_READ, aggregation=Agg.MEAN, name="mean")
    return m


def _bump_sync_on_read(strategy, m):
    """Makes the sync-on-read components differ (each replica adds its own id + 1)."""
    sync = [v for v in vars(m).values() if isinstance(v, cudist.SyncOnReadVariable)]
    if not sync:
        return

    def fn():
        r = cudist.get_replica_context().replica_id_in_sync_group
        for v in sync:
            v.assign_add(np.full(v.shape, r + 1, dtype=v.dtype))

    strategy.run(fn)


@pytest.fixture
def gpu_split_reset():
    """Physical GPU 0 back to one logical GPU after a test that split it (through make_strategy)."""
    yield
    if cudist.config.list_physical_devices("GPU"):
        set_gpu0_split(None)


@pytest.mark.parametrize("kind, dtype", ROUND_TRIPS)
@pytest.mark.usefixtures("gpu_split_reset")
def test_round_trip_every_variable_kind(tmp_path, kind, dtype):
    strategy = make_strategy(kind)
    src = _make_vars(strategy, dtype, 0)
    _bump_sync_on_read(strategy, src)
    path = train.Checkpoint(model=src).write(str(tmp_path / "rt"))
    dst = _make_vars(make_strategy(kind), dtype, 1)
    train.Checkpoint(model=dst).read(path).assert_consumed()
    for name, v in vars(src).items():
        w = getattr(dst, name)
        assert type(w) is type(v)
        _assert_same(w.numpy(), v.numpy(), name)  # the aggregate of a sync-on-read variable
        for a, b in zip(_components(w), _components(v)):
            _assert_same(a, b, f"{name} component")  # same replica count: the components themselves


def test_restore_under_another_strategy_assigns_every_component(tmp_path):
    # Mirrored 2 -> Mirrored 3, Mirrored -> OneDevice, CentralStorage -> Mirrored, OneDevice -> Mirrored 3.
    for src_kind, dst_kind in [("mirrored2", "mirrored3"), ("mirrored3", "one_device"), ("central2", "mirrored2"),
                               ("one_device", "mirrored3"), ("mirrored2", "central2")]:
        src = _make_vars(make_strategy(src_kind), np.float32, 0)
        path = train.Checkpoint(model=src).write(str(tmp_path / f"{src_kind}-{dst_kind}"))
        dst = _make_vars(make_strategy(dst_kind), np.float32, 1)
        train.Checkpoint(model=dst).read(path).assert_consumed()
        for name in ("w", "scalar", "summed", "frozen"):
            for c in _components(getattr(dst, name)):
                _assert_same(c, getattr(src, name).numpy(), f"{src_kind}->{dst_kind} {name}")


def test_sync_on_read_restore_onto_another_replica_count(tmp_path):
    s2, s3 = make_strategy("mirrored2"), make_strategy("mirrored3")
    with s2.scope():
        f = cudist.Variable(np.float32(0), synchronization=ON_READ, aggregation=Agg.SUM)
        i = cudist.Variable(np.int64(0), synchronization=ON_READ, aggregation=Agg.SUM)
        mean = cudist.Variable(np.float32(0), synchronization=ON_READ, aggregation=Agg.MEAN)
        first = cudist.Variable(np.float32(0), synchronization=ON_READ, aggregation=Agg.ONLY_FIRST_REPLICA)

    def fn():
        r = cudist.get_replica_context().replica_id_in_sync_group
        f.assign_add(np.float32(0.25 + r))  # components 0.25, 1.25: SUM 1.5
        i.assign_add(np.int64(3 + 2 * r))  # 3, 5: SUM 8
        mean.assign_add(np.float32(1 + 2 * r))  # 1, 3: MEAN 2
        first.assign_add(np.float32(5 + r))  # replica 0's: 5

    s2.run(fn)
    path = train.Checkpoint(f=f, i=i, mean=mean, first=first).write(str(tmp_path / "s"))
    with s3.scope():
        f3 = cudist.Variable(np.float32(9), synchronization=ON_READ, aggregation=Agg.SUM)
        i3 = cudist.Variable(np.int64(9), synchronization=ON_READ, aggregation=Agg.SUM)
        mean3 = cudist.Variable(np.float32(9), synchronization=ON_READ, aggregation=Agg.MEAN)
        first3 = cudist.Variable(np.float32(9), synchronization=ON_READ, aggregation=Agg.ONLY_FIRST_REPLICA)
    train.Checkpoint(f=f3, i=i3, mean=mean3, first=first3).read(path).assert_consumed()
    # SUM: value / N per component, as TF (TF 2.21: 0.1 over 3 -> 0.033333335 each).
    assert [float(c) for c in _components(f3)] == [np.float32(1.5) / np.float32(3)] * 3
    assert f3.numpy() == np.float32(1.5)
    # Integer SUM: TF truncates (8 over 3 -> [2, 2, 2], reads back 6); we keep the sum: [3, 3, 2].
    assert [int(c) for c in _components(i3)] == [3, 3, 2] and int(i3.numpy()) == 8
    # MEAN and ONLY_FIRST_REPLICA: the value in every component (TF: ONLY_FIRST_REPLICA 5.0 in all three).
    assert [float(c) for c in _components(mean3)] == [2.0] * 3
    assert [float(c) for c in _components(first3)] == [5.0] * 3
    # Onto one device: the aggregate.
    with make_strategy("one_device").scope():
        f1 = cudist.Variable(np.float32(0))
        i1 = cudist.Variable(np.int64(0))
    train.Checkpoint(f=f1, i=i1).read(path).expect_partial()
    assert f1.numpy() == np.float32(1.5) and int(i1.numpy()) == 8


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu_split_reset")
def test_restore_between_gpu_and_cpu_replicas(tmp_path):
    # GPU Mirrored 3 -> CPU Mirrored 2 and CPU CentralStorage -> GPU Mirrored 3, optimizer state included.
    src_strategy = make_strategy("mirrored_gpu3")
    m, opt = _opt_model(src_strategy, cudist.optimizers.Adam, learning_rate=0.01)
    _opt_steps(src_strategy, m, opt, range(3))
    path = train.Checkpoint(model=m, optimizer=opt).write(str(tmp_path / "gpu"))
    expected = _opt_state(m, opt)
    cpu = make_strategy("mirrored2")
    m2, opt2 = _opt_model(cpu, cudist.optimizers.Adam, learning_rate=0.01)
    train.Checkpoint(model=m2, optimizer=opt2).read(path).assert_consumed()
    for k, v in _opt_state(m2, opt2).items():
        _assert_same(v, expected[k], k)
    central = make_strategy("central2")
    m3, opt3 = _opt_model(central, cudist.optimizers.Adam, learning_rate=0.01)
    _opt_steps(central, m3, opt3, range(2))
    path = train.Checkpoint(model=m3, optimizer=opt3).write(str(tmp_path / "cpu"))
    gpu = make_strategy("mirrored_gpu3")
    m4, opt4 = _opt_model(gpu, cudist.optimizers.Adam, learning_rate=0.01)
    train.Checkpoint(model=m4, optimizer=opt4).read(path).assert_consumed()
    for k, v in _opt_state(m3, opt3).items():
        _assert_same(_opt_state(m4, opt4)[k], v, k)
    for c in m4.w.values:
        assert type(c.read_value()) is not np.ndarray  # restored onto the GPUs


def test_sync_on_read_with_aggregation_none_cannot_be_saved(tmp_path):
    # TF 2.21: ValueError "Could not convert from `tf.VariableAggregation` NONE to `tf.distribute.ReduceOp` type".
    with make_strategy("mirrored2").scope():
        v = cudist.Variable(1.0, synchronization=ON_READ, aggregation=Agg.NONE)
    with pytest.raises(ValueError, match="aggregation NONE"):
        train.Checkpoint(v=v).write(str(tmp_path / "x"))
    assert os.listdir(tmp_path) == []


# ================================================================================ optimizers
def _grads(step: int, shapes):
    rng = np.random.default_rng(100 + step)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _opt_model(strategy, opt_cls, **opt_kwargs):
    with strategy.scope():
        m = Model()
        m.w = cudist.Variable(np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3), name="w")
        m.b = cudist.Variable(np.zeros(3, np.float32), name="b")
        opt = opt_cls(**opt_kwargs)
    return m, opt


def _opt_steps(strategy, m, opt, steps):
    shapes = [(4, 3), (3,)]
    for step in steps:
        gs = _grads(step, shapes)

        def fn(gs=gs):
            r = cudist.get_replica_context().replica_id_in_sync_group
            opt.apply_gradients([(g * np.float32(r + 1), v) for g, v in zip(gs, (m.w, m.b))])

        strategy.run(fn)


def _opt_state(m, opt):
    out = {"w": m.w.numpy(), "b": m.b.numpy(), "iterations": opt.iterations.numpy()}
    for name in ("w", "b"):
        for slot in opt._slot_names:
            out[f"{name}/{slot}"] = opt.get_slot(getattr(m, name), slot).numpy()
    return out


@pytest.mark.parametrize("kind", ["one_device", "mirrored2", "central2"])
@pytest.mark.parametrize("opt_cls, kwargs", [
    (cudist.optimizers.Adam, {"learning_rate": 0.01}),
    (cudist.optimizers.SGD, {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
], ids=["adam", "sgd_nesterov"])
def test_optimizer_state_restored_into_a_fresh_optimizer_continues_bit_identically(tmp_path, kind, opt_cls, kwargs):
    strategy = make_strategy(kind)
    m, opt = _opt_model(strategy, opt_cls, **kwargs)
    _opt_steps(strategy, m, opt, range(5))
    path = train.Checkpoint(model=m, optimizer=opt).save(str(tmp_path / "ckpt"))
    _opt_steps(strategy, m, opt, range(5, 9))
    expected = _opt_state(m, opt)

    strategy2 = make_strategy(kind)
    fresh_kwargs = dict(kwargs, learning_rate=0.5)  # restored from the checkpoint, as Keras 3 does
    m2, opt2 = _opt_model(strategy2, opt_cls, **fresh_kwargs)
    with strategy2.scope():
        m2.w.assign(np.zeros((4, 3), np.float32))
    assert len(opt2.variables) == 2  # iterations and learning_rate, no slots yet: the restore creates them
    status = train.Checkpoint(model=m2, optimizer=opt2).restore(path)
    status.assert_consumed()
    assert opt2.learning_rate == kwargs["learning_rate"]
    assert int(opt2.iterations) == 5
    _opt_steps(strategy2, m2, opt2, range(5, 9))
    got = _opt_state(m2, opt2)
    assert got.keys() == expected.keys()
    for k in expected:
        _assert_same(got[k], expected[k], k)


def test_optimizer_index_records_hyperparameters_and_slot_links(tmp_path):
    strategy = make_strategy("mirrored2")
    m, opt = _opt_model(strategy, cudist.optimizers.Adam, learning_rate=0.003, beta_1=0.8, name="adam")
    _opt_steps(strategy, m, opt, range(1))
    path = train.Checkpoint(model=m, optimizer=opt).write(str(tmp_path / "x"))
    index = json.loads(Path(path + ".index.json").read_text())
    rec = index["objects"]["optimizer"]
    assert rec["kind"] == "optimizer" and rec["optimizer_class"] == "Adam"
    assert rec["hyperparameters"] == {"learning_rate": 0.003, "beta_1": 0.8, "beta_2": 0.999, "epsilon": 1e-7, "name": "adam"}
    assert rec["iterations"] == "optimizer/iterations"
    assert rec["slots"] == {
        "model/w": {"momentum": "model/w/.OPTIMIZER_SLOT/optimizer/momentum",
                    "velocity": "model/w/.OPTIMIZER_SLOT/optimizer/velocity"},
        "model/b": {"momentum": "model/b/.OPTIMIZER_SLOT/optimizer/momentum",
                    "velocity": "model/b/.OPTIMIZER_SLOT/optimizer/velocity"},
    }
    slot = index["objects"]["model/w/.OPTIMIZER_SLOT/optimizer/velocity"]
    assert (slot["kind"], slot["variable"], slot["slot"], slot["optimizer"]) == ("slot", "model/w", "velocity", "optimizer")
    # As TF: slots of a variable that is not in the checkpoint are not saved.
    path = train.Checkpoint(optimizer=opt).write(str(tmp_path / "y"))
    assert not [k for k in json.loads(Path(path + ".index.json").read_text())["objects"] if "OPTIMIZER_SLOT" in k]


# ================================================================================ status (TF 2.21's semantics)
def _simple(strategy=None, with_sub=True):
    with (strategy or make_strategy("one_device")).scope():
        m = Model()
        m.w = cudist.Variable(np.zeros(2, np.float32))
        if with_sub:
            m.sub = Model()
            m.sub.k = cudist.Variable(np.zeros((1, 2), np.int32))
    return m


def test_status_assertions_match_tf(tmp_path):
    m = _simple()
    m.w.assign([1.0, 2.0])
    m.sub.k.assign([[3, 4]])
    ckpt = train.Checkpoint(model=m)
    ckpt.save(str(tmp_path / "ckpt"))
    p2 = ckpt.save(str(tmp_path / "ckpt"))

    # Everything matched: TF 2.21 passes assert_consumed and assert_existing_objects_matched;
    # expect_partial() returns the status itself.
    m2 = _simple()
    status = train.Checkpoint(model=m2).restore(p2)
    assert status.assert_consumed() is status
    assert status.assert_existing_objects_matched() is status
    assert status.expect_partial() is status
    assert status.assert_nontrivial_match() is status
    _assert_same(m2.sub.k.numpy(), np.array([[3, 4]], np.int32))

    # The program lacks an object the checkpoint has: TF raises "Unresolved object in checkpoint
    # (root).model.sub.k" from assert_consumed; assert_existing_objects_matched passes.
    status = train.Checkpoint(model=_simple(with_sub=False)).restore(p2)
    with pytest.raises(AssertionError, match="Unresolved object in checkpoint.*model/sub/k"):
        status.assert_consumed()
    status.assert_existing_objects_matched()

    # The program has an object the checkpoint lacks: TF raises "Found 1 Python objects that were
    # not bound to checkpointed values, likely due to changes in the Python program." from both.
    with make_strategy("one_device").scope():
        extra = cudist.Variable(1.0)
    status = train.Checkpoint(model=_simple(), extra=extra).restore(p2)
    for check in (status.assert_consumed, status.assert_existing_objects_matched):
        with pytest.raises(AssertionError, match="Found 1 Python objects that were not bound to checkpointed values"):
            check()
    assert float(extra.numpy()) == 1.0

    # read() does not create save_counter, so the checkpoint's stays unresolved (TF: assert_consumed
    # raises "Unresolved object in checkpoint (root).save_counter", existing-objects passes) and is
    # applied when the counter is created later (TF: 2).
    ck = train.Checkpoint(model=_simple())
    status = ck.read(p2)
    with pytest.raises(AssertionError, match="save_counter"):
        status.assert_consumed()
    status.assert_existing_objects_matched()
    assert int(ck.save_counter) == 2

    # restore() creates save_counter first: a checkpoint written by a Checkpoint that never saved
    # has none, so the counter is an unbound Python object (TF: both assertions raise naming it).
    fresh_writer = train.Checkpoint(model=_simple())
    w = fresh_writer.write(str(tmp_path / "w"))
    status = train.Checkpoint(model=_simple()).restore(w)
    for check in (status.assert_consumed, status.assert_existing_objects_matched):
        with pytest.raises(AssertionError, match="save_counter"):
            check()
    train.Checkpoint(model=_simple()).read(w).assert_consumed()

    # restore(None): TF's InitializationOnlyStatus, whose assertions raise "No checkpoint specified
    # (save_path=None); nothing is being restored." and whose expect_partial() passes.
    status = train.Checkpoint(model=_simple()).restore(None)
    for check in (status.assert_consumed, status.assert_existing_objects_matched):
        with pytest.raises(AssertionError, match=r"No checkpoint specified \(save_path=None\)"):
            check()
    assert status.expect_partial() is status


def test_restore_errors(tmp_path):
    m = _simple()
    p = train.Checkpoint(model=m).write(str(tmp_path / "x"))
    # TF: NotFoundError "Failed to find any matching files for ..."
    with pytest.raises(FileNotFoundError, match="Failed to find any matching files"):
        train.Checkpoint(model=_simple()).restore(str(tmp_path / "nope"))
    # TF: ValueError "Received incompatible tensor with shape (2,) when attempting to restore variable with shape (3,)"
    bad = _simple()
    with make_strategy("one_device").scope():
        bad.w = cudist.Variable(np.full(3, 7, np.float32))
    bad.sub.k.assign([[5, 5]])
    with pytest.raises(ValueError, match=r"incompatible tensor with shape \(2,\).*shape \(3,\)"):
        train.Checkpoint(model=bad).restore(p)
    _assert_same(bad.sub.k.numpy(), np.array([[5, 5]], np.int32))  # checked before anything was assigned
    # TF: InvalidArgumentError "expected dtype int32 does not equal original dtype float"
    with make_strategy("one_device").scope():
        bad.w = cudist.Variable(np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="dtype float32.*dtype int32"):
        train.Checkpoint(model=bad).restore(p)
    # A shape= with unknown dimensions takes another shape.
    with make_strategy("one_device").scope():
        bad.w = cudist.Variable(np.zeros(5, np.float32), shape=(None,))
    train.Checkpoint(model=bad).restore(p).expect_partial()
    assert bad.w.numpy().shape == (2,)
    # TF: ValueError "`Checkpoint` was expecting x to be a trackable object ..."
    with pytest.raises(ValueError, match="was expecting x to be a trackable object"):
        train.Checkpoint(x=5)
    with pytest.raises(ValueError, match="was expecting y to be a trackable object"):
        train.Checkpoint(y=np.zeros(3))
    strategy = make_strategy("mirrored2")
    ckpt = train.Checkpoint(model=_simple(strategy))
    with pytest.raises(RuntimeError, match="cross-replica context"):
        strategy.run(lambda: ckpt.save(str(tmp_path / "in_run")))


def test_save_numbering_write_and_state_file(tmp_path):
    ckpt = train.Checkpoint(model=_simple())
    # TF: save -> <prefix>-1, -2; write -> exactly the prefix, save_counter untouched (2);
    # the state file names the latest save; restore sets save_counter, so the next save is -3.
    assert ckpt.save(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt-1")
    p2 = ckpt.save(str(tmp_path / "ckpt"))
    assert p2 == str(tmp_path / "ckpt-2") and int(ckpt.save_counter) == 2
    assert ckpt.write(str(tmp_path / "wr")) == str(tmp_path / "wr") and int(ckpt.save_counter) == 2
    state = json.loads((tmp_path / "checkpoint").read_text())
    assert state == {"model_checkpoint_path": "ckpt-2", "all_model_checkpoint_paths": ["ckpt-2"]}
    assert train.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-2")
    ck2 = train.Checkpoint(model=_simple())
    ck2.restore(p2).assert_consumed()
    assert ck2.save(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt-3")
    # The index path itself is accepted too.
    train.Checkpoint(model=_simple()).restore(p2 + ".index.json").assert_consumed()
    assert train.latest_checkpoint(tmp_path / "empty") is None


# ================================================================================ the object graph
def test_nested_objects_containers_and_shared_variables(tmp_path):
    with make_strategy("mirrored2").scope():
        m = Model()
        m.layers = [Model(), Model()]
        m.layers[0].kernel = cudist.Variable(np.ones((2, 2), np.float32))
        m.layers[1].kernel = cudist.Variable(np.full((2, 2), 2, np.float32))
        m.table = {"a/b": cudist.Variable(np.float32(3)), "c.d": (cudist.Variable(np.float32(4)),)}
        m.alias = m.layers[0].kernel  # the same variable twice: saved once, at its first (BFS) path
        m.note = "not tracked"
        m.array = np.zeros(3)  # plain arrays are not tracked (as in TF)
    path = train.Checkpoint(model=m).write(str(tmp_path / "n"))
    keys = list(json.loads(Path(path + ".index.json").read_text())["objects"])
    # TF's escaping: "/" -> "./", "." -> ".."
    assert sorted(keys) == sorted(["model/alias", "model/layers/1/kernel", "model/table/a./b", "model/table/c..d/0"])
    with make_strategy("mirrored3").scope():
        m2 = Model()
        m2.layers = [Model(), Model()]
        m2.layers[0].kernel = cudist.Variable(np.zeros((2, 2), np.float32))
        m2.layers[1].kernel = cudist.Variable(np.zeros((2, 2), np.float32))
        m2.table = {"a/b": cudist.Variable(np.float32(0)), "c.d": (cudist.Variable(np.float32(0)),)}
        m2.alias = m2.layers[0].kernel
    train.Checkpoint(model=m2).read(path).assert_consumed()
    assert m2.layers[0].kernel.numpy().tolist() == [[1, 1], [1, 1]] and float(m2.table["c.d"][0].numpy()) == 4
    with pytest.raises(ValueError, match="not a string"):
        train.Checkpoint(model={1: m.alias}).write(str(tmp_path / "bad"))


def test_checkpoint_attributes_and_nested_checkpoints(tmp_path):
    inner = train.Checkpoint(model=_simple())
    outer = train.Checkpoint(inner=inner)
    outer.extra = _simple(with_sub=False)  # assigning an attribute adds a dependency, as in TF
    assert outer.inner is inner
    path = outer.write(str(tmp_path / "o"))
    keys = set(json.loads(Path(path + ".index.json").read_text())["objects"])
    assert keys == {"inner/model/w", "inner/model/sub/k", "extra/w"}


# ================================================================================ iterators
def _dist_iter(strategy, n=10, batch=4):
    ds = cudist.data.Dataset.from_tensor_slices(np.arange(n * batch, dtype=np.float32).reshape(n * batch, 1)).batch(batch)
    return iter(strategy.experimental_distribute_dataset(ds))


def _first_row(step):
    vals = step.values if isinstance(step, cudist.DistributedValues) else (step,)
    return float(np.concatenate([np.asarray(v).ravel() for v in vals])[0])


def test_iterator_position(tmp_path):
    strategy = make_strategy("mirrored2")
    it = _dist_iter(strategy)
    for _ in range(3):
        next(it)
    ckpt = train.Checkpoint(iterator=it)
    path = ckpt.write(str(tmp_path / "it"))
    assert json.loads(Path(path + ".index.json").read_text())["objects"]["iterator"] == {"kind": "iterator", "position": 3}
    next(it), next(it)
    ckpt.read(path).assert_consumed()  # back to step 3: re-created and replayed
    assert _first_row(next(it)) == 12.0
    # A fresh iterator under another replica count skips 3 steps.
    it3 = _dist_iter(make_strategy("mirrored3"))
    train.Checkpoint(iterator=it3).read(path).assert_consumed()
    step = next(it3)
    assert [np.asarray(v).ravel().tolist() for v in step.values] == [[12.0, 13.0], [14.0, 15.0], []]
    # An input shorter than the position cannot be restored.
    short = _dist_iter(strategy, n=2)
    with pytest.raises(ValueError, match="ends after 2 steps"):
        train.Checkpoint(iterator=short).read(path)
    # distribute_datasets_from_function iterators too.
    dfn = iter(strategy.distribute_datasets_from_function(
        lambda ctx: cudist.data.Dataset.from_tensor_slices(np.arange(40, dtype=np.float32)).batch(2)))
    train.Checkpoint(iterator=dfn).read(path).assert_consumed()
    assert _first_row(next(dfn)) == 12.0


# ================================================================================ the manager
def test_manager_max_to_keep_and_recovery(tmp_path):
    ckpt = train.Checkpoint(model=_simple())
    manager = train.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    assert manager.latest_checkpoint is None and manager.checkpoints == []
    for _ in range(4):
        manager.save()
    # TF 2.21: ['ckpt-3', 'ckpt-4'] kept, the older ones deleted, the state file lists both.
    expected = [str(tmp_path / "ckpt-3"), str(tmp_path / "ckpt-4")]
    assert manager.checkpoints == expected and manager.latest_checkpoint == expected[-1]
    files = sorted(os.listdir(tmp_path))
    assert files[0] == "checkpoint" and [f.split(".")[0] for f in files[1:]] == ["ckpt-3", "ckpt-3", "ckpt-4", "ckpt-4"]
    state = json.loads((tmp_path / "checkpoint").read_text())
    assert state["model_checkpoint_path"] == "ckpt-4" and state["all_model_checkpoint_paths"] == ["ckpt-3", "ckpt-4"]
    assert len(state["all_model_checkpoint_timestamps"]) == 2 and "last_preserved_timestamp" in state
    # checkpoint_number names it; save_counter is still incremented (TF: ckpt-10, then ckpt-6).
    assert manager.save(checkpoint_number=10) == str(tmp_path / "ckpt-10")
    assert manager.save() == str(tmp_path / "ckpt-6")
    # A new manager on the directory recovers the state (TF: latest ckpt-6, ['ckpt-10', 'ckpt-6']).
    again = train.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    assert again.latest_checkpoint == str(tmp_path / "ckpt-6")
    assert again.checkpoints == [str(tmp_path / "ckpt-10"), str(tmp_path / "ckpt-6")]
    assert train.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-6")


def test_manager_keep_checkpoint_every_n_hours(tmp_path, monkeypatch):
    # TF 2.21, time.time patched: created at t=1000, a save every 20 minutes, max_to_keep=1,
    # keep_checkpoint_every_n_hours=1: the 3rd (t=4600) and 6th (t=8200) saves are preserved,
    # `checkpoints` lists only the latest, last_preserved_timestamp 8200.
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    manager = train.CheckpointManager(train.Checkpoint(model=_simple()), tmp_path, max_to_keep=1,
                                      keep_checkpoint_every_n_hours=1)
    for _ in range(8):
        now[0] += 1200
        manager.save()
    monkeypatch.undo()
    kept = sorted({f.split(".")[0] for f in os.listdir(tmp_path) if f.endswith(".index.json")})
    assert kept == ["ckpt-3", "ckpt-6", "ckpt-8"]
    assert manager.checkpoints == [str(tmp_path / "ckpt-8")]
    state = json.loads((tmp_path / "checkpoint").read_text())
    assert state["last_preserved_timestamp"] == 8200.0 and state["all_model_checkpoint_timestamps"] == [10600.0]


def test_manager_options(tmp_path):
    ckpt = train.Checkpoint(model=_simple())
    # TF: ValueError "Expected a positive integer or `None` for `max_to_keep`, got 0."
    for bad in (0, -1):
        with pytest.raises(ValueError, match="Expected a positive integer or `None` for `max_to_keep`"):
            train.CheckpointManager(ckpt, tmp_path, max_to_keep=bad)
    keep_all = train.CheckpointManager(ckpt, tmp_path / "all", max_to_keep=None, checkpoint_name="model")
    for _ in range(3):
        keep_all.save()
    assert [os.path.basename(p) for p in keep_all.checkpoints] == ["model-1", "model-2", "model-3"]
    called = []
    fresh = train.CheckpointManager(ckpt, tmp_path / "none", init_fn=lambda: called.append(1))
    assert fresh.restore_or_initialize() is None and called == [1]
    assert keep_all.restore_or_initialize() == str(tmp_path / "all" / "model-3")
    with make_strategy("one_device").scope():
        step = cudist.Variable(np.int64(0))
    every = train.CheckpointManager(ckpt, tmp_path / "every", step_counter=step, checkpoint_interval=3)
    saved = []
    for i in range(7):
        step.assign(i)
        saved.append(every.save() is not None)
    assert saved == [True, False, False, True, False, False, True]


# ================================================================================ format, atomicity, streaming
def test_tensors_file_is_standard_safetensors(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    strategy = make_strategy("mirrored2")
    with strategy.scope():
        m = Model()
        m.f16 = cudist.Variable(np.arange(6, dtype=np.float16).reshape(2, 3))
        m.i64 = cudist.Variable(np.arange(4, dtype=np.int64))
        m.c128 = cudist.Variable(np.array([1 + 2j, -3j], np.complex128))
        m.b = cudist.Variable(np.array([True, False]))
        m.total = cudist.Variable(np.float32(0), synchronization=ON_READ, aggregation=Agg.SUM)
    strategy.run(lambda: m.total.assign_add(np.float32(1.5)))
    path = train.Checkpoint(model=m).write(str(tmp_path / "f"))
    index = json.loads(Path(path + ".index.json").read_text())
    data = tmp_path / index["tensors"]
    assert data.name.startswith("f.data-") and data.name.endswith(".safetensors")
    tensors = st.load_file(str(data))
    assert set(tensors) == {"model/f16", "model/i64", "model/c128", "model/b", "model/total",
                            "model/total/.PER_REPLICA/0", "model/total/.PER_REPLICA/1"}
    _assert_same(tensors["model/f16"], m.f16.numpy())
    _assert_same(tensors["model/i64"], m.i64.numpy())
    _assert_same(tensors["model/b"], m.b.numpy())
    assert tensors["model/total"] == np.float32(3.0) and tensors["model/total/.PER_REPLICA/1"] == np.float32(1.5)
    # complex128 (which safetensors lacks) as float64 (real, imaginary) pairs; the index keeps the dtype.
    c = m.c128.numpy()
    _assert_same(tensors["model/c128"], np.stack([c.real, c.imag], axis=-1))
    assert index["objects"]["model/c128"]["dtype"] == "complex128"
    rec = index["objects"]["model/total"]
    assert (rec["variable_class"], rec["aggregation"], rec["replicas"]) == ("SyncOnReadVariable", "SUM", 2)


def test_interrupted_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    from cudist.train import _format

    m = _simple()
    manager = train.CheckpointManager(train.Checkpoint(model=m), tmp_path, max_to_keep=3)
    first = manager.save()
    before = sorted(os.listdir(tmp_path))

    def boom(key):
        raise KeyboardInterrupt("interrupted while writing tensors")

    monkeypatch.setattr(_format, "tensor_written", boom)
    m.w.assign([9.0, 9.0])
    with pytest.raises(KeyboardInterrupt):
        manager.save()
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == before  # no temporary file, no new index
    assert train.latest_checkpoint(tmp_path) == first
    m2 = _simple()
    train.Checkpoint(model=m2).restore(first).assert_consumed()
    assert m2.w.numpy().tolist() == [0.0, 0.0]


def test_overwriting_a_checkpoint_keeps_one_tensors_file(tmp_path):
    m = _simple()
    ckpt = train.Checkpoint(model=m)
    for value in (1.0, 2.0, 3.0):
        m.w.assign([value, value])
        ckpt.write(str(tmp_path / "same"))
    assert len(glob.glob(str(tmp_path / "same.data-*.safetensors"))) == 1
    m2 = _simple()
    train.Checkpoint(model=m2).read(str(tmp_path / "same")).assert_consumed()
    assert m2.w.numpy().tolist() == [3.0, 3.0]


def test_save_and_restore_stream_one_tensor_at_a_time(tmp_path, monkeypatch):
    # 12 variables of 2 MiB: a save must not hold copies of them all (np.savez of a dict would),
    # a restore must not load them all before assigning when they are over its hold budget (it
    # checks every tensor first, then reads each again to assign it).
    from cudist.train import _checkpoint

    monkeypatch.setattr(_checkpoint, "RESTORE_HOLD_BYTES", 0)
    strategy = make_strategy("mirrored2")
    n, size = 12, 2 << 20
    with strategy.scope():
        m = Model()
        m.ws = [cudist.Variable(np.full(size // 4, i, np.float32)) for i in range(n)]
        m.sums = [cudist.Variable(np.zeros(size // 4, np.float32), synchronization=ON_READ, aggregation=Agg.SUM)
                  for _ in range(3)]
    ckpt = train.Checkpoint(model=m)
    tracemalloc.start()
    try:
        path = ckpt.write(str(tmp_path / "big"))
        _, peak_save = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        train.Checkpoint(model=m).read(path).assert_consumed()
        _, peak_read = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_save < 2.5 * size, f"save peaked at {peak_save / size:.1f} tensors"
    assert peak_read < 2.5 * size, f"restore peaked at {peak_read / size:.1f} tensors"
    assert float(m.ws[7].numpy()[-1]) == 7.0


def test_only_the_chief_writes(tmp_path, monkeypatch):
    strategy = make_strategy("mirrored2")
    m = _simple(strategy)
    monkeypatch.setattr(strategy.extended, "should_checkpoint", False, raising=False)
    ckpt = train.Checkpoint(model=m)
    assert ckpt.save(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt-1")
    manager = train.CheckpointManager(ckpt, tmp_path / "m")
    assert manager.save() == str(tmp_path / "m" / "ckpt-2")
    # No files; a manager's directory exists (TF's multi-worker tutorial removes a non-chief's afterwards).
    assert list(tmp_path.rglob("*")) == [tmp_path / "m"] and int(ckpt.save_counter) == 2


# ================================================================================ copies, pickle, import
def test_variables_and_optimizers_copy_and_pickle():
    v = cudist.Variable(np.arange(3, dtype=np.float32), name="plain", trainable=False, shape=(None,))
    u = pickle.loads(pickle.dumps(v))
    assert (u.name, u.dtype, u.trainable, u.shape, u.device) == ("plain:0", v.dtype, False, (None,), v.device)
    _assert_same(u.numpy(), v.numpy())
    d = copy.deepcopy(v)
    d.assign([7, 7, 7])
    assert v.numpy().tolist() == [0, 1, 2]

    strategy = make_strategy("mirrored2")
    m, opt = _opt_model(strategy, cudist.optimizers.SGD, learning_rate=0.1, momentum=0.9)
    _opt_steps(strategy, m, opt, range(2))
    with strategy.scope():
        total = cudist.Variable(1.0, synchronization=ON_READ, aggregation=Agg.SUM)
    central = _simple(make_strategy("central2"), with_sub=False).w
    for dv in (m.w, total, central):
        with pytest.raises(TypeError, match=r"cannot pickle .*cudist\.train\.Checkpoint"):
            pickle.dumps(dv)
        c = copy.deepcopy(dv)
        assert type(c) is type(dv) and c is not dv
        for a, b in zip(_components(c), _components(dv)):
            _assert_same(a, b)
    with pytest.raises(TypeError, match=r"cannot pickle optimizer .*cudist\.train\.Checkpoint"):
        pickle.dumps(opt)
    # A model and its optimizer deep-copied together train on independently, identically.
    m2, opt2 = copy.deepcopy((m, opt))
    assert opt2.get_slot(m2.w, "momentum") is not opt.get_slot(m.w, "momentum")
    _opt_steps(strategy, m, opt, range(2, 4))
    _opt_steps(strategy, m2, opt2, range(2, 4))
    for k, val in _opt_state(m, opt).items():
        _assert_same(_opt_state(m2, opt2)[k], val, k)


def test_import_cudist_does_not_import_train_or_safetensors():
    code = "import sys, cudist; print(sorted(m for m in sys.modules if m.startswith(('cudist.train', 'safetensors'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# ================================================================================ kill tests
#
# The training run: MirroredStrategy, a linear model trained with SGD momentum on a dataset
# iterator, a cudist.metrics.Mean of the loss (float32 sync-on-read total and count) and an integer
# sync-on-read example count, a CheckpointManager saving every K steps. It stops after T steps and
# writes its final state (variables, slots, iterations, metric components, iterator position and
# next batch).

T, K, BATCH = 12, 3, 8


class Trainer:
    def __init__(self, n: int, directory=None):
        rng = np.random.default_rng(7)
        self.strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
        with self.strategy.scope():
            self.model = Model()
            self.model.w = cudist.Variable(rng.standard_normal((6, 3)).astype(np.float32), name="w")
            self.model.b = cudist.Variable(np.zeros(3, np.float32), name="b")
            self.opt = cudist.optimizers.SGD(0.05, momentum=0.9)
            self.loss = cudist.metrics.Mean(name="loss")
            self.seen = cudist.Variable(np.int64(0), synchronization=ON_READ, aggregation=Agg.SUM)
        x = rng.standard_normal(((T + 2) * BATCH, 6)).astype(np.float32)
        y = (x @ rng.standard_normal((6, 3)) + 0.1).astype(np.float32)
        ds = cudist.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        self.iterator = iter(self.strategy.experimental_distribute_dataset(ds))
        self.ckpt = train.Checkpoint(model=self.model, optimizer=self.opt, iterator=self.iterator,
                                     metrics={"loss": self.loss, "seen": self.seen})
        self.manager = None if directory is None else train.CheckpointManager(self.ckpt, directory, max_to_keep=2)

    def step(self):
        m, opt = self.model, self.opt

        def fn(x, y):
            err = x @ m.w + m.b - y
            gw = (np.float32(2) * (x.T @ err) / np.float32(BATCH)).astype(np.float32)
            gb = (np.float32(2) * err.sum(axis=0) / np.float32(BATCH)).astype(np.float32)
            opt.apply_gradients([(gw, m.w), (gb, m.b)])
            self.loss.update_state((err * err).sum(axis=1))
            self.seen.assign_add(np.int64(len(x)))

        x, y = next(self.iterator)
        self.strategy.run(fn, args=(x, y))
        return int(self.opt.iterations)

    def state(self) -> dict:
        m, opt = self.model, self.opt
        out = {"iterations": opt.iterations.numpy(), "loss": np.asarray(self.loss.result()), "seen": self.seen.numpy(),
               "position": np.int64(self.iterator._checkpoint_state()["position"])}
        for name, v in (("w", m.w), ("b", m.b), ("w/momentum", opt.get_slot(m.w, "momentum")),
                        ("b/momentum", opt.get_slot(m.b, "momentum"))):
            for i, c in enumerate(_components(v)):
                out[f"{name}/{i}"] = c
        for name, v in (("loss/total", self.loss.total), ("loss/count", self.loss.count), ("seen", self.seen)):
            for i, c in enumerate(_components(v)):
                out[f"{name}/replica_{i}"] = c
        nxt = next(self.iterator)[0]
        out["next_batch"] = np.concatenate([np.asarray(c) for c in nxt.values])
        return out

    def load(self, other: Trainer):
        """Moves ``other``'s training state in by assignment (the reference for a replica-count change)."""
        n = self.strategy.num_replicas_in_sync
        values = {name: getattr(other.model, name).numpy() for name in ("w", "b")}
        slots = {name: other.opt.get_slot(getattr(other.model, name), "momentum").numpy() for name in ("w", "b")}
        iterations, seen = other.opt.iterations.numpy(), int(other.seen.numpy())
        loss = [other.loss.total.numpy(), other.loss.count.numpy()]
        with self.strategy.scope():
            self.opt.build([self.model.w, self.model.b])
            for name in ("w", "b"):
                getattr(self.model, name).assign(values[name])
                self.opt.get_slot(getattr(self.model, name), "momentum").assign(slots[name])
            self.opt.iterations.assign(iterations)
            self.loss.total.assign(loss[0])  # cross-replica assigns of SUMs: value / N each (TF)
            self.loss.count.assign(loss[1])
        q, r = divmod(seen, n)  # the documented integer split: the remainder first
        for i, c in enumerate(self.seen.values):
            c.assign(np.int64(q + (i < r)))
        for _ in range(int(iterations)):
            next(self.iterator)


def _train_main(argv):
    """``python tests/test_checkpoint.py train N DIR OUT [--pause data|direct|commit@SAVE]``"""
    n, directory, out = int(argv[0]), argv[1], argv[2]
    pause = argv[4] if len(argv) > 4 and argv[3] == "--pause" else None
    cudist.config.set_logical_device_configuration(
        cudist.config.list_physical_devices("CPU")[0], [cudist.config.LogicalDeviceConfiguration()] * 4)
    trainer = Trainer(n, directory)
    latest = train.latest_checkpoint(directory)
    if latest is not None:
        trainer.ckpt.restore(latest).assert_consumed()
    print("RESTORED", latest, int(trainer.opt.iterations), flush=True)
    saves = 0
    if pause is not None:
        from cudist.train import _format

        where, at = pause.split("@")

        def hold(*_):
            if saves + 1 == int(at):
                print("PAUSED", where, flush=True)
                time.sleep(60)

        if where in ("data", "direct"):
            _format.tensor_written = hold  # after the first tensor: a half-written tensors file
            if where == "direct":  # every save through O_DIRECT, however small (where the file system has it)
                _format._DIRECT_MIN_BYTES = 0
                os.environ["CUDIST_CHECKPOINT_DIRECT_IO"] = "on"
        else:
            _format.before_commit = hold  # the tensors file complete, its index not yet written
    while int(trainer.opt.iterations) < T:
        step = trainer.step()
        print("STEP", step, flush=True)
        time.sleep(0.01)  # room for the test's SIGKILL to land mid-run
        if step % K == 0:
            trainer.manager.save()
            saves += 1
    np.savez(out, **trainer.state())
    print("DONE", flush=True)


def _run(n, directory, out, *extra):
    return subprocess.Popen([sys.executable, str(HERE), "train", str(n), str(directory), str(out), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_when(proc, prefix: str):
    """SIGKILLs ``proc`` once it prints a line starting with ``prefix``."""
    with proc:
        for line in proc.stdout:
            if line.startswith(prefix):
                proc.send_signal(signal.SIGKILL)
                break
        err = proc.stderr.read()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"the run ended by itself ({proc.returncode}): {err[-2000:]}"


def _finish(n, directory, out):
    proc = _run(n, directory, out)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    restored = stdout.splitlines()[0].split()
    return restored, dict(np.load(out))


@functools.lru_cache(maxsize=None)
def _reference(n: int, switch_to=None, at=0) -> dict:
    trainer = Trainer(n)
    while int(trainer.opt.iterations) < (at if switch_to else T):
        trainer.step()
    if switch_to:
        other, trainer = trainer, Trainer(switch_to)
        trainer.load(other)
        while int(trainer.opt.iterations) < T:
            trainer.step()
    return trainer.state()


def _assert_states_equal(got: dict, want: dict, note: str):
    assert got.keys() == want.keys(), note
    for k in want:
        assert _bits(got[k]) == _bits(want[k]), f"{note}: {k} differs: {got[k]!r} != {want[k]!r}"


@pytest.mark.parametrize("n", [2, 3])
def test_sigkill_at_a_random_step_then_resume_is_bit_identical(tmp_path, n):
    kill_at = random.Random().randrange(K + 1, T - 1)  # after a checkpoint (step K's save precedes "STEP K+1"), before the end
    note = f"{n} replicas, SIGKILL after step {kill_at}"
    _kill_when(_run(n, tmp_path / "ckpts", tmp_path / "unused.npz"), f"STEP {kill_at}\n")
    latest = train.latest_checkpoint(tmp_path / "ckpts")
    restored, state = _finish(n, tmp_path / "ckpts", tmp_path / "out.npz")
    assert restored[1] == str(latest), note
    _assert_states_equal(state, _reference(n), note)


@pytest.mark.parametrize("where", ["data", "direct", "commit"])
def test_sigkill_in_the_middle_of_save_keeps_the_previous_checkpoint(tmp_path, where):
    ckpts = tmp_path / "ckpts"
    _kill_when(_run(2, ckpts, tmp_path / "unused.npz", "--pause", f"{where}@2"), "PAUSED")
    # Killed in the 2nd save (step 6): the 1st is the latest, complete; the 2nd left only debris
    # (a temporary tensors file, or a complete tensors file that no index names).
    assert train.latest_checkpoint(ckpts) == str(ckpts / "ckpt-1")
    assert not (ckpts / "ckpt-2.index.json").exists()
    debris = glob.glob(str(ckpts / ".ckpt-2.data-*.tmp")) if where != "commit" else glob.glob(str(ckpts / "ckpt-2.data-*"))
    assert len(debris) == 1, os.listdir(ckpts)
    restored, state = _finish(2, ckpts, tmp_path / "out.npz")
    assert restored[1:] == [str(ckpts / "ckpt-1"), "3"]
    _assert_states_equal(state, _reference(2), f"killed in save ({where})")
    # The resumed run re-saved ckpt-2 over the debris and kept max_to_keep=2 checkpoints, nothing else.
    names = sorted(os.listdir(ckpts))
    assert [f for f in names if f.endswith(".index.json")] == ["ckpt-3.index.json", "ckpt-4.index.json"], names
    assert len(names) == 5 and "checkpoint" in names and not [f for f in names if f.startswith(".")], names


def test_sigkill_then_resume_on_another_replica_count(tmp_path):
    # "STEP k" is printed before step k's save: a kill after step K + 1 finds the step-K checkpoint.
    kill_at = random.Random().randrange(K + 1, T - 1)  # at least one checkpoint
    _kill_when(_run(2, tmp_path / "ckpts", tmp_path / "unused.npz"), f"STEP {kill_at}\n")
    restored, state = _finish(3, tmp_path / "ckpts", tmp_path / "out.npz")
    at = int(restored[2])
    assert at % K == 0 and at > 0
    # The reference: 2 replicas up to the checkpoint's step, then 3 from the state moved over by assignment.
    _assert_states_equal(state, _reference(2, switch_to=3, at=at), f"SIGKILL after step {kill_at}, 2 -> 3 replicas")


# ================================================================================ multi-worker
def _multi_worker_main(directory: str):
    """One worker of ``python -m cudist.launch -n 2 tests/test_checkpoint.py multi_worker DIR``."""
    from mpi4py import MPI

    from cudist.train import _format

    strategy = cudist.MultiWorkerMirroredStrategy(devices=["/cpu:0"])
    chief = bool(strategy.extended.should_checkpoint)
    if not chief:
        def refuse(*args, **kwargs):
            raise AssertionError("a worker that is not the chief wrote checkpoint files")

        _format.write_checkpoint = _format.write_state = _format.atomic_write_json = refuse

    def build():
        with strategy.scope():
            w = cudist.Variable(np.arange(4, dtype=np.float32))
            total = cudist.Variable(np.float32(0), synchronization=ON_READ, aggregation=Agg.SUM)
            count = cudist.Variable(np.int64(0), synchronization=ON_READ, aggregation=Agg.SUM)
            opt = cudist.optimizers.SGD(0.1, momentum=0.9)
        return train.Checkpoint(w=w, total=total, count=count, optimizer=opt), w, total, count, opt

    ckpt, w, total, count, opt = build()

    def step():
        r = cudist.get_replica_context().replica_id_in_sync_group
        opt.apply_gradients([(np.full(4, r + 1, np.float32), w)])
        total.assign_add(np.float32(0.5 * (r + 1)))
        count.assign_add(np.int64(2 * r + 1))

    for _ in range(3):
        strategy.run(step)
    path = train.CheckpointManager(ckpt, directory).save()  # every worker saves; the chief writes
    strategy.reduce("sum", np.ones(1, np.float32), axis=None)  # a barrier: the chief has committed
    want = [w.numpy(), opt.get_slot(w, "momentum").numpy(), opt.iterations.numpy(), total.numpy(), count.numpy()]
    ckpt2, w2, total2, count2, opt2 = build()
    ckpt2.restore(train.latest_checkpoint(directory)).assert_consumed()
    got = [w2.numpy(), opt2.get_slot(w2, "momentum").numpy(), opt2.iterations.numpy(), total2.numpy(), count2.numpy()]
    ok = all(_bits(a) == _bits(b) for a, b in zip(got, want))
    local = [int(c.numpy()) for c in count2.values]
    results = MPI.COMM_WORLD.gather([chief, path, ok, local, [np.asarray(x).tolist() for x in got]], root=0)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print("RESULT", json.dumps(results), flush=True)


def _mpi_missing():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed"
    from cudist.launch import find_mpiexec

    return None if find_mpiexec() is not None else "no mpiexec"


@pytest.mark.multi_worker
@pytest.mark.skipif(_mpi_missing() is not None, reason=f"multi-worker jobs need MPI: {_mpi_missing()}")
def test_multi_worker_only_the_chief_writes_and_every_worker_restores(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "CUDIST_CHECK_COLLECTIVES")}
    proc = subprocess.run([sys.executable, "-m", "cudist.launch", "-n", "2", "--no-prefix", str(HERE), "multi_worker", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    (chief0, path0, ok0, local0, got0), (chief1, path1, ok1, local1, got1) = json.loads(line[len("RESULT "):])
    assert (chief0, chief1) == (True, False)
    assert path0 == path1 == str(tmp_path / "ckpt-1") and ok0 and ok1 and got0 == got1
    assert got0[3] == 4.5 and got0[4] == 12  # total: 3 x (0.5 + 1.0); count: 3 x (1 + 3)
    assert local0 + local1 == [6, 6]  # the integer sum split over the job's 2 replicas
    assert sorted(p.name.split(".")[0] for p in tmp_path.iterdir()) == ["checkpoint", "ckpt-1", "ckpt-1"]


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "train":
    _train_main(sys.argv[2:])
elif __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "multi_worker":
    _multi_worker_main(sys.argv[2])
