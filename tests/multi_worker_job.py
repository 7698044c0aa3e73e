"""One worker of the multi-worker test jobs (``tests/test_multi_worker.py`` starts them under mpiexec).

``python multi_worker_job.py parity R``: every check of MultiWorkerMirroredStrategy (R local replicas
per worker) against a MirroredStrategy over all W*R replicas computed in the same process; prints
``RESULT <rank> <json>`` with one entry per check: [ok, detail].
``python multi_worker_job.py raise|kill|hang``: a worker that fails; the job must end, naming it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

import cudist
from cudist import data


def _rank_size():
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


class Checks:
    def __init__(self):
        self.results = {}

    def check(self, name, ok, detail=""):
        self.results[name] = [bool(ok), str(detail)[:400]]

    def run(self, name, fn):
        try:
            fn()
        except Exception:  # noqa: BLE001 - reported, so that one failure does not hide the others
            self.results[name] = [False, traceback.format_exc()[-1500:]]


def same(a, b, exact):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"shape/dtype {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    if exact:
        ok = np.array_equal(a, b, equal_nan=True)
    else:
        tol = 2e-2 if a.dtype == np.float16 else 1e-5
        ok = np.allclose(a, b, rtol=tol, atol=tol)
    return ok, "" if ok else f"{a.ravel()[:6]} vs {b.ravel()[:6]}"


def report(rank, payload):
    """Rank 0 prints every worker's results, one ``RESULT <rank> <json>`` line each (no interleaving)."""
    from mpi4py import MPI

    everything = MPI.COMM_WORLD.gather(payload, root=0)
    if rank == 0:
        for r, p in enumerate(everything):
            print("RESULT", r, json.dumps(p), flush=True)


def parity(R, exact_workers=False):
    rank, W = _rank_size()
    G = W * R
    cpu = cudist.config.list_physical_devices("CPU")[0]
    cudist.config.set_logical_device_configuration(cpu, [cudist.config.LogicalDeviceConfiguration()] * G)
    # 2 workers x 1 replica: one addition per element, as MirroredStrategy; N workers x 1 replica when
    # the caller knows every sum is in worker order (one node's shared memory, CUDIST_SHM_MIN_BYTES=0).
    exact = R == 1 and (W == 2 or exact_workers)
    mw = cudist.MultiWorkerMirroredStrategy(devices=[f"/cpu:{i}" for i in range(R)])
    ref = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(G)])
    mine = [rank * R + r for r in range(R)]  # this worker's global replica ids
    c = Checks()

    def local(strategy, x):
        return strategy.experimental_local_results(x)

    def compare(name, got, want_all, exact_=None):
        got = local(mw, got)
        want = [local(ref, want_all)[g] for g in mine]
        for r, (a, b) in enumerate(zip(got, want)):
            ok, why = same(a, b, exact if exact_ is None else exact_)
            if not ok:
                c.check(name, False, f"replica {mine[r]}: {why}")
                return
        c.check(name, True)

    # ---- cluster facts
    ext = mw.extended
    c.check("num_replicas_in_sync", mw.num_replicas_in_sync == G, mw.num_replicas_in_sync)
    c.check("chief", ext.should_checkpoint == (rank == 0) and ext.should_save_summary == (rank == 0), rank)
    c.check("resolver", mw.cluster_resolver.task_type == "worker" and mw.cluster_resolver.task_id == rank,
            repr(mw.cluster_resolver))
    ids = mw.run(lambda: cudist.get_replica_context().replica_id_in_sync_group)
    c.check("replica_ids", list(local(mw, ids)) == mine, local(mw, ids))

    # ---- run + all_reduce
    def values(g, dt, shape=(5, 3)):
        rng = np.random.default_rng(100 + g)
        if np.dtype(dt).kind in "iu":
            return rng.integers(-50, 50, shape).astype(dt)
        return (rng.standard_normal(shape) * 10).astype(dt)

    for dt in (np.float32, np.float64, np.float16, np.int32, np.int64):
        for op in ("sum", "mean"):

            def step(dt=dt, op=op):
                ctx = cudist.get_replica_context()
                return ctx.all_reduce(op, values(ctx.replica_id_in_sync_group, dt))

            # float16 is summed in float32 over every replica in worker order (issue 28): exact on any layout.
            exact_f16 = True if dt == np.float16 else None
            compare(f"all_reduce_{op}_{np.dtype(dt).name}", mw.run(step), ref.run(step), exact_f16)

    def nest_step():
        ctx = cudist.get_replica_context()
        g = ctx.replica_id_in_sync_group
        return ctx.all_reduce("sum", {"a": values(g, np.float32, (7,)), "b": (np.float32(g), values(g, np.int32, (2, 2))),
                                     "c": values(g, np.float32, (300,))})

    got, want = mw.run(nest_step), ref.run(nest_step)
    for key in ("a", "c"):
        compare(f"all_reduce_nest_{key}", got[key], want[key])
    compare("all_reduce_nest_scalar", got["b"][0], want["b"][0])
    compare("all_reduce_nest_int", got["b"][1], want["b"][1])

    # packed into several buffers (bytes_per_pack): the same result
    mw_packs = cudist.MultiWorkerMirroredStrategy(
        communication_options=cudist.experimental.CommunicationOptions(bytes_per_pack=64),
        devices=[f"/cpu:{i}" for i in range(R)],
    )
    got = mw_packs.run(nest_step)
    compare("all_reduce_bytes_per_pack", got["c"], want["c"])

    # ---- all_gather (ragged along axis 0)
    def gather_step():
        ctx = cudist.get_replica_context()
        g = ctx.replica_id_in_sync_group
        return ctx.all_gather(values(g, np.float32, (g + 1, 2)), 0), ctx.all_gather(values(g, np.float32, (2, 3)), 1)

    got, want = mw.run(gather_step), ref.run(gather_step)
    compare("all_gather_axis0_ragged", got[0], want[0], True)
    compare("all_gather_axis1", got[1], want[1], True)

    # ---- reduce / gather in cross-replica context
    def per_replica(strategy, shape_of):
        return strategy.experimental_distribute_values_from_function(
            lambda vc: values(vc.replica_id_in_sync_group, np.float32, shape_of(vc.replica_id_in_sync_group))
        )

    for axis in (None, 0):
        for op in ("sum", "mean"):
            shape_of = (lambda g: (g + 1, 3)) if axis == 0 else (lambda g: (4, 3))
            a = mw.reduce(op, per_replica(mw, shape_of), axis=axis)
            b = ref.reduce(op, per_replica(ref, shape_of), axis=axis)
            ok, why = same(a, b, exact)
            c.check(f"reduce_{op}_axis{axis}", ok, why)
    a = mw.gather(per_replica(mw, lambda g: (g + 1, 3)), 0)
    b = ref.gather(per_replica(ref, lambda g: (g + 1, 3)), 0)
    c.check("gather", *same(a, b, True))

    # ---- variables
    S, A = cudist.VariableSynchronization, cudist.VariableAggregation

    def make(strategy, sync, agg, dtype=np.float32):
        with strategy.scope():
            # A worker-dependent initial value: the chief's must win.
            init = np.full(4, 1.5 + (rank if strategy is mw else 0), dtype)
            return cudist.Variable(init, synchronization=sync, aggregation=agg)

    for agg in (A.NONE, A.SUM, A.MEAN, A.ONLY_FIRST_REPLICA):
        vm, vr = make(mw, S.ON_WRITE, agg), make(ref, S.ON_WRITE, agg)

        def upd(v):
            ctx = cudist.get_replica_context()
            g = ctx.replica_id_in_sync_group
            v.assign_add(values(g, np.float32, (4,)))
            return v.read_value()

        mw.run(upd, args=(vm,))
        ref.run(upd, args=(vr,))
        got = [x.numpy() for x in vm.values]
        want = [vr.values[g].numpy() for g in mine]
        ok = all(same(a, b, exact)[0] for a, b in zip(got, want))
        c.check(f"var_on_write_{agg.name}", ok, f"{got[0]} vs {want[0]}")

    for agg in (A.SUM, A.MEAN, A.ONLY_FIRST_REPLICA):
        vm, vr = make(mw, S.ON_READ, agg), make(ref, S.ON_READ, agg)

        def upd_local(v):
            g = cudist.get_replica_context().replica_id_in_sync_group
            v.assign(values(g, np.float32, (4,)))

        mw.run(upd_local, args=(vm,))
        ref.run(upd_local, args=(vr,))
        c.check(f"var_on_read_{agg.name}_read", *same(vm.numpy(), vr.numpy(), exact))
        if agg is not A.ONLY_FIRST_REPLICA:
            with mw.scope():
                vm.assign(np.full(4, 6.0, np.float32))
            with ref.scope():
                vr.assign(np.full(4, 6.0, np.float32))
            c.check(f"var_on_read_{agg.name}_assign", *same(vm.numpy(), vr.numpy(), exact))
    vi_m, vi_r = make(mw, S.ON_WRITE, A.SUM, np.int32), make(ref, S.ON_WRITE, A.SUM, np.int32)
    step_i = lambda v: v.assign_add(np.full(4, cudist.get_replica_context().replica_id_in_sync_group + 1, np.int32))  # noqa: E731
    mw.run(step_i, args=(vi_m,))
    ref.run(step_i, args=(vi_r,))
    c.check("var_int_sum", *same(vi_m.numpy(), vi_r.numpy(), True))

    # ---- optimizers
    for name, make_opt in (
        ("sgd_momentum", lambda: cudist.optimizers.SGD(0.1, momentum=0.9)),
        ("adam", lambda: cudist.optimizers.Adam(0.01)),
    ):
        finals = []
        for strategy in (mw, ref):
            with strategy.scope():
                w = cudist.Variable(np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8) + (rank if strategy is mw else 0))
                b = cudist.Variable(np.zeros(8, np.float32))
                opt = make_opt()

            def train_step(it, w=w, b=b, opt=opt):
                g = cudist.get_replica_context().replica_id_in_sync_group
                gw = values(10 * it + g, np.float32, (8, 8))
                gb = values(10 * it + g + 5, np.float32, (8,))
                opt.apply_gradients([(gw, w), (gb, b)])

            for it in range(3):
                strategy.run(train_step, args=(it,))
            finals.append((w.numpy(), b.numpy(), int(opt.iterations.numpy())))
        (wm, bm, im), (wr, br, ir) = finals
        ok = same(wm, wr, exact)[0] and same(bm, br, exact)[0] and im == ir
        c.check(f"optimizer_{name}", ok, f"{wm.ravel()[:3]} vs {wr.ravel()[:3]}, iterations {im} vs {ir}")

    # ---- datasets: each shard policy
    B = 7  # not a multiple of G: partial pieces
    source = np.arange(5 * B * 2, dtype=np.float32).reshape(5 * B, 2)

    def dataset(policy=None):
        ds = data.Dataset.from_tensor_slices(source).batch(B)
        if policy is not None:
            o = data.Options()
            o.experimental_distribute.auto_shard_policy = policy
            ds = ds.with_options(o)
        return ds

    def steps_of(strategy, ds):
        return [[np.asarray(x) for x in local(strategy, step)] for step in strategy.experimental_distribute_dataset(ds)]

    P = data.AutoShardPolicy
    want_steps = steps_of(ref, dataset())
    want_mine = [[s[g] for g in mine] for s in want_steps]
    for policy in (None, P.AUTO, P.DATA):
        got = steps_of(mw, dataset(policy))
        ok = len(got) == len(want_mine) and all(
            same(a, b, True)[0] for gs, ws in zip(got, want_mine) for a, b in zip(gs, ws)
        )
        c.check(f"dataset_{'default' if policy is None else policy.name}", ok, f"{len(got)} vs {len(want_mine)} steps")
    dd = mw.experimental_distribute_dataset(dataset(P.AUTO))
    c.check("dataset_policy_said", dd.auto_shard_policy is P.DATA, dd.auto_shard_policy)
    # OFF, as TF 2.21: every worker reads every row, re-split into per-replica batches of TF's
    # batch_sizes_for_worker sizes (floor/ceil of B / G, worker 0's ceilings first, rotated by
    # rank * R), cycled across the global batches; R of them a step, the last step padded with empties.
    got = steps_of(mw, dataset(P.OFF))
    floor, ceil_count = divmod(B, G)
    sizes0 = [floor + 1] * ceil_count + [floor] * (G - ceil_count)
    sizes = sizes0[rank * R :] + sizes0[: rank * R]
    pieces, start, k = [], 0, 0
    while start < len(source):
        pieces.append(source[start : start + sizes[k]])
        start, k = start + sizes[k], (k + 1) % G
    pieces += [source[:0]] * (-len(pieces) % R)
    expect = [pieces[i : i + R] for i in range(0, len(pieces), R)]
    ok = len(got) == len(expect) and all(same(a, b, True)[0] for gs, ws in zip(got, expect) for a, b in zip(gs, ws))
    c.check("dataset_OFF", ok, f"{len(got)} vs {len(expect)} steps")
    try:
        mw.experimental_distribute_dataset(dataset(P.FILE))
        c.check("dataset_FILE_refused", False, "no error")
    except cudist.errors.NotFoundError as e:  # TF 2.21's class (tests/data/tf_multi_worker.json)
        c.check("dataset_FILE_refused", "FILE" in str(e), e)
    # TF 2.21: the element_spec is per replica, even for one local replica, with a batch dimension of
    # None (drop_remainder or not); PER_REPLICA input is refused (MirroredStrategy's only).
    from cudist._input_lib import PerReplicaSpec

    spec = mw.experimental_distribute_dataset(data.Dataset.range(8).batch(4, drop_remainder=True)).element_spec
    want_spec = PerReplicaSpec(*[data.TensorSpec((None,), np.int64)] * R)
    c.check("dataset_element_spec", spec == want_spec, spec)
    try:
        mw.distribute_datasets_from_function(
            lambda ctx: data.Dataset.range(4).batch(2),
            options=cudist.InputOptions(experimental_replication_mode=cudist.InputReplicationMode.PER_REPLICA),
        )
        c.check("from_function_per_replica_refused", False, "no error")
    except NotImplementedError as e:
        c.check("from_function_per_replica_refused", "MirroredStrategy" in str(e), e)

    # ---- distribute_datasets_from_function: once per worker, its InputContext; uneven lengths
    seen = []

    def dataset_fn(ctx):
        seen.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
        per_replica = ctx.get_per_replica_batch_size(2 * G)
        n_rows = 4 * G * 2 - 2 * ctx.input_pipeline_id  # the last worker has less data
        rows = np.arange(n_rows * 2, dtype=np.float32).reshape(n_rows, 2) + 1000 * ctx.input_pipeline_id
        return data.Dataset.from_tensor_slices(rows).shard(1, 0).batch(per_replica)

    steps = [[np.asarray(x) for x in local(mw, s)] for s in mw.distribute_datasets_from_function(dataset_fn)]
    c.check("from_function_context", seen == [(W, rank, G)], seen)
    counts = mw.extended._communicator.comm.allgather(len(steps))
    c.check("from_function_steps_together", len(set(counts)) == 1, counts)
    rows = sum(int(x.shape[0]) for s in steps for x in s)
    c.check("from_function_rows", rows == 4 * G * 2 - 2 * rank, rows)

    # ---- values from function: global ids
    v = mw.experimental_distribute_values_from_function(
        lambda vc: np.array([vc.replica_id_in_sync_group, vc.num_replicas_in_sync])
    )
    c.check("values_from_function", [x.tolist() for x in local(mw, v)] == [[g, G] for g in mine], local(mw, v))

    # ---- debug mode: mismatched collectives are named
    os.environ["CUDIST_CHECK_COLLECTIVES"] = "1"
    checked = cudist.MultiWorkerMirroredStrategy(devices=[f"/cpu:{i}" for i in range(R)])
    del os.environ["CUDIST_CHECK_COLLECTIVES"]
    try:
        checked.run(lambda: cudist.get_replica_context().all_reduce("sum", np.ones(3 + rank, np.float32)))
        c.check("mismatch_detected", False, "no error")
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        c.check("mismatch_detected", type(e).__name__ == "ReplicaMismatchError" and "worker 1" in msg
                and "float32(3,)" in msg and "float32(4,)" in msg, msg)
    checked.run(lambda: cudist.get_replica_context().all_reduce("sum", np.ones(3, np.float32)))  # still usable

    # ---- the default check (no CUDIST_CHECK_COLLECTIVES): 6 floats against 4 is an error, never garbage
    quick = cudist.MultiWorkerMirroredStrategy(devices=[f"/cpu:{i}" for i in range(R)])
    for name, nest in (("default_mismatch_count", lambda: np.ones(4 + 2 * (rank == 0), np.float32)),
                       ("default_mismatch_dtype", lambda: np.ones(4, np.float32 if rank == 0 else np.int32))):
        try:
            got = quick.run(lambda nest=nest: cudist.get_replica_context().all_reduce("sum", nest()))
            c.check(name, False, f"no error: {local(quick, got)}")
        except Exception as e:  # noqa: BLE001
            msg = str(e)
            c.check(name, type(e).__name__ == "ReplicaMismatchError" and "worker 0: collective #" in msg
                    and "worker 1: collective #" in msg, msg)
        quick = cudist.MultiWorkerMirroredStrategy(devices=[f"/cpu:{i}" for i in range(R)])  # the last one is broken
    try:  # the same buffer, but a reduce on worker 0 where worker 1 all-reduces (a chief-only metric read)
        if rank == 0:
            quick.reduce("sum", quick.run(lambda: np.ones(2, np.float32)), axis=None)
        else:
            quick.run(lambda: cudist.get_replica_context().all_reduce("sum", np.ones(2, np.float32)))
        c.check("default_mismatch_kind", False, "no error")
    except Exception as e:  # noqa: BLE001
        c.check("default_mismatch_kind", type(e).__name__ == "ReplicaMismatchError", str(e))

    report(rank, c.results)


def failing(mode):
    rank, _ = _rank_size()
    options = cudist.experimental.CommunicationOptions(timeout_seconds=2 if mode == "hang" else None)
    strategy = cudist.MultiWorkerMirroredStrategy(communication_options=options)
    print(f"READY {rank} {time.time():.3f}", flush=True)
    if rank == 1:
        if mode == "raise":
            raise ZeroDivisionError("worker 1 fails on purpose")
        if mode == "kill":
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "hang":
            time.sleep(60)
    strategy.run(lambda: cudist.get_replica_context().all_reduce("sum", np.ones(4, np.float32)))
    print(f"UNREACHABLE {rank}", flush=True)


def _shm_transport(strategy):
    return strategy.extended.host_transport


def _shm_setup(strategy=True):
    """The shm jobs' start: this worker's rank, the worker count W, W logical CPUs, the strategy under test
    (None when ``strategy`` is false: the job makes its own), MirroredStrategy over the same W replicas (the
    reference) and the job's Checks."""
    rank, W = _rank_size()
    cpu = cudist.config.list_physical_devices("CPU")[0]
    cudist.config.set_logical_device_configuration(cpu, [cudist.config.LogicalDeviceConfiguration()] * W)
    mw = cudist.MultiWorkerMirroredStrategy() if strategy else None
    ref = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(W)])
    return rank, W, mw, ref, Checks()


def shm(exact):
    """The shared-memory transport (CUDIST_SHM_MIN_BYTES=0: every host all-reduce) against MirroredStrategy
    over the same replicas: every kernel dtype, odd sizes, SUM and MEAN, nests and packs, results held
    past the transport's result banks; prints RESULT lines as parity does."""
    from cudist import optimizers

    rank, W, mw, ref, c = _shm_setup()
    transport = _shm_transport(mw)
    c.check("transport", transport is not None and "shared memory" in mw.extended._cross_device_ops.host_implementation,
            repr(transport))

    def values(g, dt, n):
        rng = np.random.default_rng(1000 * g + n)
        if np.dtype(dt).kind in "iu":
            return rng.integers(-50, 50, n).astype(dt)
        return (rng.standard_normal(n) * 10).astype(dt)

    def compare(name, got, want, exact_=exact):
        ok, why = same(mw.experimental_local_results(got)[0], ref.experimental_local_results(want)[rank], exact_)
        c.check(name, ok, why)

    dtypes = [np.float32, np.float64, np.float16, np.int32, np.int64]
    if exact:  # one node: bfloat16 (which MPI cannot carry) too, summed by NumPy's kernels as MirroredStrategy sums it
        try:
            import ml_dtypes

            dtypes.append(ml_dtypes.bfloat16)
        except ImportError:
            pass
    for dt in dtypes:
        for n in (1, 7, 1000, 4099, 65537):
            for op in ("sum", "mean"):

                def step(dt=dt, n=n, op=op):
                    ctx = cudist.get_replica_context()
                    return ctx.all_reduce(op, values(ctx.replica_id_in_sync_group, dt, n))

                name = f"{op}_{np.dtype(dt).name}_{n}"
                got, want = mw.run(step), ref.run(step)
                if np.dtype(dt).name == "bfloat16" and op == "mean":
                    # the bfloat16 sum (exact, checked above) divided after its rounding, where MirroredStrategy
                    # divides the float32 accumulation: one bfloat16 rounding apart
                    a = np.asarray(mw.experimental_local_results(got)[0], np.float32)
                    b = np.asarray(ref.experimental_local_results(want)[rank], np.float32)
                    c.check(name, np.allclose(a, b, rtol=1e-2, atol=1e-2), f"{a[:4]} vs {b[:4]}")
                else:
                    compare(name, got, want)

    def nest_step():
        ctx = cudist.get_replica_context()
        g = ctx.replica_id_in_sync_group
        return ctx.all_reduce("sum", {"a": values(g, np.float32, 7), "b": values(g, np.int32, 33),
                                     "c": values(g, np.float32, 3001), "d": values(g, np.float64, 5)})

    want = ref.run(nest_step)
    for name, strategy in (("nest", mw), ("packs", cudist.MultiWorkerMirroredStrategy(
            communication_options=cudist.experimental.CommunicationOptions(bytes_per_pack=256)))):
        got = strategy.run(nest_step)
        for key in "abcd":
            ok, why = same(strategy.experimental_local_results(got[key])[0], ref.experimental_local_results(want[key])[rank],
                           exact)
            c.check(f"{name}_{key}", ok, why)

    # Results held past the banks (sizes of the reduce-scatter): none is overwritten by the later
    # all-reduces, and none is writable.
    from cudist._dataplane.transports import shm as shm_lib

    def held_step(k):
        return cudist.get_replica_context().all_reduce("sum", values(cudist.get_replica_context().replica_id_in_sync_group,
                                                                     np.float32, shm_lib.EAGER_BYTES // 4 + 1000 + k))

    held = [mw.run(held_step, args=(k,)) for k in range(7)]
    for k, got in enumerate(held):
        compare(f"held_{k}", got, ref.run(held_step, args=(k,)))
    c.check("read_only", not mw.experimental_local_results(held[0])[0].flags.writeable)
    del held
    compare("after_release", mw.run(held_step, args=(1,)), ref.run(held_step, args=(1,)))

    # A training step (SGD momentum): the variables stay as MirroredStrategy's over the same replicas.
    def train(strategy):
        with strategy.scope():
            w = cudist.Variable(np.linspace(-1, 1, 3000, dtype=np.float32).reshape(1000, 3))
            opt = optimizers.SGD(0.05, momentum=0.9)

        def tstep():
            g = cudist.get_replica_context().replica_id_in_sync_group
            grad = values(g, np.float32, 3000).reshape(1000, 3) * np.float32(0.01)
            opt.apply_gradients([(grad, w)])

        for _ in range(3):
            strategy.run(tstep)
        return w

    got_w, want_w = train(mw), train(ref)
    ok, why = same(np.asarray(got_w.read_value()), np.asarray(want_w.read_value()), exact)
    c.check("sgd_momentum", ok, why)
    st = transport.stats if transport is not None else {}
    if exact:  # one node: small calls take the one-round path, none MPI
        c.check("used_shared_memory", st.get("calls", 0) >= 10 and st.get("eager_calls", 0) >= 10
                and st.get("mpi_calls", 1) == 0, st)
    else:  # several nodes: small calls cross them by MPI, large ones by shared memory then the leaders
        c.check("used_shared_memory", st.get("calls", 0) >= 10, st)
    report(rank, c.results)


def shm_train():
    """Training over the reduce-scatter path (50000 float32 per tensor: read-only shared results): four
    optimizers, ON_WRITE SUM and MEAN variables, a MEAN all-reduce and a reduce, each against MirroredStrategy
    over the same replicas, bit for bit (one node)."""
    from cudist import optimizers

    rank, W, mw, ref, c = _shm_setup()
    n = 50000

    def vals(g, k):
        return (np.random.default_rng(g * 31 + k).standard_normal(n) * 0.01).astype(np.float32)

    makers = {"sgd": lambda: optimizers.SGD(0.1), "momentum": lambda: optimizers.SGD(0.1, momentum=0.9),
              "adam": lambda: optimizers.Adam(0.01), "rmsprop": lambda: optimizers.RMSprop(0.01)}
    for name, make in makers.items():
        outs = []
        for s in (mw, ref):
            with s.scope():
                w = cudist.Variable(np.linspace(-1, 1, n, dtype=np.float32))
                v_sum = cudist.Variable(np.zeros(n, np.float32), synchronization=cudist.VariableSynchronization.ON_WRITE,
                                        aggregation=cudist.VariableAggregation.SUM)
                v_mean = cudist.Variable(np.zeros(n, np.float32), aggregation=cudist.VariableAggregation.MEAN)
                opt = make()

            def step(k, w=w, v_sum=v_sum, v_mean=v_mean, opt=opt):
                g = cudist.get_replica_context().replica_id_in_sync_group
                opt.apply_gradients([(vals(g, k), w)])
                v_sum.assign_add(vals(g, k + 100))
                v_mean.assign(vals(g, k + 200))
                return cudist.get_replica_context().all_reduce("mean", vals(g, k + 300))

            for k in range(4):
                r = s.run(step, args=(k,))
            red = s.reduce("sum", s.run(lambda: vals(cudist.get_replica_context().replica_id_in_sync_group, 9)), axis=None)
            outs.append([w.read_value(), v_sum.read_value(), v_mean.read_value(), s.experimental_local_results(r)[0], red])
        for what, a, b in zip(("weights", "on_write_sum", "mean_variable", "all_reduce_mean", "reduce"), *outs):
            ok, why = same(np.asarray(a), np.asarray(b), True)
            c.check(f"{name}_{what}", ok, why)
    st = _shm_transport(mw).stats
    c.check("reduce_scatter_used", st["calls"] >= 60 and st["mpi_calls"] == 0, st)
    report(rank, c.results)


def shm_model():
    """A model of several variables (odd sizes, one worker's slice of a pack cutting through variables) trained
    over the reduce-scatter, the gradients never packed (``allreduce_packs``), with one pack and with several
    (``bytes_per_pack``): momentum and Adam, and a MEAN all-reduce of a nest; bit for bit MirroredStrategy's."""
    from cudist import optimizers

    rank, W, _, ref, c = _shm_setup(strategy=False)
    shapes = [(37, 129), (129,), (129, 1001), (1001,), (1001, 3), (3,)]

    def grads(g, k):
        rng = np.random.default_rng(g * 131 + k)
        return [(rng.standard_normal(sh) * 0.01).astype(np.float32) for sh in shapes]

    for per_pack in (0, 200_000):
        mw = cudist.MultiWorkerMirroredStrategy(
            communication_options=cudist.experimental.CommunicationOptions(bytes_per_pack=per_pack))
        for name, make in (("momentum", lambda: optimizers.SGD(0.1, momentum=0.9)), ("adam", lambda: optimizers.Adam(0.01))):
            outs = []
            for s in (mw, ref):
                with s.scope():
                    vs = [cudist.Variable(np.linspace(-1, 1, int(np.prod(sh)), dtype=np.float32).reshape(sh))
                          for sh in shapes]
                    opt = make()

                def step(k, vs=vs, opt=opt):
                    g = cudist.get_replica_context().replica_id_in_sync_group
                    opt.apply_gradients(zip(grads(g, k), vs))

                for k in range(4):
                    s.run(step, args=(k,))
                outs.append([np.asarray(v.read_value()) for v in vs])
            for j, (a, b) in enumerate(zip(*outs)):
                ok, why = same(a, b, True)
                c.check(f"{name}_pack{per_pack}_var{j}", ok, why)

        def nest(k=7):
            g = cudist.get_replica_context().replica_id_in_sync_group
            return cudist.get_replica_context().all_reduce("mean", grads(g, k))

        got, want = mw.run(nest), ref.run(nest)
        for j, (a, b) in enumerate(zip(got, want)):
            ok, why = same(mw.experimental_local_results(a)[0], ref.experimental_local_results(b)[rank], True)
            c.check(f"nest_mean_pack{per_pack}_{j}", ok, why)
        st = _shm_transport(mw).stats
        c.check(f"unpacked_pack{per_pack}", st["unpacked_calls"] == st["calls"] == 9 and st["mpi_calls"] == 0, st)
    report(rank, c.results)


def pipeline(R):
    """``CUDIST_PIPELINE_UPDATE=on`` against the unpipelined reduction, bit for bit: a model of odd-sized
    float32 and bfloat16 variables (and a float32 variable holding a bfloat16 one's place in no pack of its
    own) trained by three optimizers with one pack, two packs and many packs (``bytes_per_pack``), R local
    replicas per worker, over the transport the environment picks; with one node, MirroredStrategy's bits too.
    A gradient that is a view of its own variable is read as it was before the step."""
    import ml_dtypes

    from cudist import _settings, optimizers

    rank, W = _rank_size()
    cpu = cudist.config.list_physical_devices("CPU")[0]
    cudist.config.set_logical_device_configuration(cpu, [cudist.config.LogicalDeviceConfiguration()] * (W * R))
    ref = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(W * R)])
    mine = [f"/cpu:{i}" for i in range(R)]
    bf16 = np.dtype(ml_dtypes.bfloat16)
    mixed = [((37, 129), np.float32), ((129,), np.float32), ((300, 101), bf16), ((129, 1001), np.float32),
             ((1001,), bf16), ((1001, 3), np.float32), ((3,), np.float32), ((50_001,), np.float32)]
    c = Checks()

    def grads(g, k, specs):
        rng = np.random.default_rng(g * 131 + k)
        return [(rng.standard_normal(sh) * 0.01).astype(dt) for sh, dt in specs]

    makers = (("momentum", lambda: optimizers.SGD(0.1, momentum=0.9)), ("adam", lambda: optimizers.Adam(0.01)),
              ("adamw", lambda: optimizers.AdamW(0.01, weight_decay=0.1)))
    # One pack: float32 alone, bytes_per_pack 0 (nothing to pipeline); two: one per dtype; many: 20 kB packs.
    for per_pack, packs in ((0, "one"), (0, "two"), (20_000, "many")):
        specs = [sp for sp in mixed if sp[1] is np.float32] if packs == "one" else mixed
        opts = cudist.experimental.CommunicationOptions(bytes_per_pack=per_pack)
        with _settings.overridden(_settings.PIPELINE_UPDATE, "on"):
            on = cudist.MultiWorkerMirroredStrategy(communication_options=opts, devices=mine)
        off = cudist.MultiWorkerMirroredStrategy(communication_options=opts, devices=mine)
        for name, make in makers:
            outs = []
            for s in (on, off, ref):
                with s.scope():
                    vs = [cudist.Variable(np.linspace(-1, 1, int(np.prod(sh)), dtype=np.float32).astype(dt).reshape(sh))
                          for sh, dt in specs]
                    opt = make()

                def step(k, vs=vs, opt=opt, specs=specs):
                    g = cudist.get_replica_context().replica_id_in_sync_group
                    gs = grads(g, k, specs)
                    if k == 3:  # a gradient that is the variable's own memory (read before the step writes it)
                        gs[1] = np.from_dlpack(vs[1])
                    opt.apply_gradients(zip(gs, vs))

                for k in range(5):
                    s.run(step, args=(k,))
                # (the storage itself: a bfloat16 variable's read_value goes through a memoryview, which has no bfloat16)
                outs.append([np.array(v.storage.primary) for v in vs])
            for j, (a, b, m) in enumerate(zip(*outs)):
                ok, why = same(a, b, True)
                c.check(f"{name}_{packs}_var{j}_vs_unpipelined", ok, why)
                # MirroredStrategy's bits with one replica per worker on one node (R > 1: each worker sums
                # its replicas first, float32 tolerance; bfloat16 sums every replica in order: its bits).
                exact = (R == 1 and _settings.node_size() is None) or a.dtype == bf16
                ok, why = same(a.astype(np.float32), m.astype(np.float32), exact)
                c.check(f"{name}_{packs}_var{j}_vs_mirrored", ok, why)
        ops = on.extended._cross_device_ops  # private-read: the test reads how many reductions were pipelined
        want = 0 if packs == "one" else 5 * len(makers)
        c.check(f"pipelined_{packs}", ops.pipelined_calls == want, ops.pipelined_calls)
        c.check(f"unpipelined_{packs}", off.extended._cross_device_ops.pipelined_calls == 0)  # private-read: as above
    # experimental_aggregate_gradients=False, as TF's: the user reduces (one all_reduce of the list), then
    # apply_gradients only updates -- no collective of its own -- with the bits of the aggregating step.
    specs = mixed
    with on.scope():
        va = [cudist.Variable(np.ones(sh, np.float32).astype(dt)) for sh, dt in specs]
        vb = [cudist.Variable(np.ones(sh, np.float32).astype(dt)) for sh, dt in specs]
        opt_a, opt_b = optimizers.Adam(0.01), optimizers.Adam(0.01)
    comm = on.extended._communicator  # private-read: the test counts the collectives apply_gradients makes
    made = []

    def user_step(k):
        g = cudist.get_replica_context().replica_id_in_sync_group
        gs = grads(g, k, specs)
        opt_a.apply_gradients(zip(gs, va))
        summed = cudist.get_replica_context().all_reduce("sum", gs)
        before = comm.seq
        opt_b.apply_gradients(zip(summed, vb), experimental_aggregate_gradients=False)
        made.append(comm.seq - before)

    for k in range(3):
        on.run(user_step, args=(k,))
    ok = all(np.array_equal(np.array(a.storage.primary).view(np.uint8), np.array(b.storage.primary).view(np.uint8))
             for a, b in zip(va, vb))
    # (the first step creates Adam's slots, each broadcast from the chief as every variable is)
    c.check("aggregate_false_is_update_only", ok and made[R:] == [0] * (2 * R), made)
    import threading

    c.check("no_thread_left", [t.name for t in threading.enumerate() if t.name == "cudist-comm"] == [],
            threading.enumerate())
    report(rank, c.results)


def shm_small():
    """The one-round path's single C++ call (one array per worker through strategy.run): sizes around the
    one-round threshold (both sides of it), every dtype of that path and float16, SUM and MEAN, several
    calls in a row (the two slot sets used by turns), against MirroredStrategy over the same replicas, bit
    for bit; the transport's counters show which path each size took."""
    from cudist._dataplane.transports import shm as shm_lib

    rank, W, mw, ref, c = _shm_setup()
    transport = _shm_transport(mw)
    eager = shm_lib.EAGER_BYTES

    def values(g, dt, n, k):
        rng = np.random.default_rng(7919 * g + 31 * n + k)
        if np.dtype(dt).kind in "iu":
            return rng.integers(-1000, 1000, n).astype(dt)
        return (rng.standard_normal(n) * 10).astype(dt)

    expected_eager = 0
    for dt in (np.float32, np.float64, np.int32, np.int64, np.float16):
        size = np.dtype(dt).itemsize
        below, at = (eager - 64) // size, eager // size  # the last size of the one-round path, the first past it
        for n in (1, 3, below - 1, below, at - 1, at, at + 1):
            for op in ("sum", "mean") if np.dtype(dt).kind == "f" else ("sum",):
                for k in range(3):
                    def step(dt=dt, n=n, op=op, k=k):
                        ctx = cudist.get_replica_context()
                        return ctx.all_reduce(op, values(ctx.replica_id_in_sync_group, dt, n, k))

                    before = transport.stats["eager_calls"]
                    got, want = mw.run(step), ref.run(step)
                    ok, why = same(mw.experimental_local_results(got)[0], ref.experimental_local_results(want)[rank], True)
                    c.check(f"{op}_{np.dtype(dt).name}_{n}_{k}", ok, why)
                    if dt is not np.float16:  # (float16 takes MPI's all-gather: summed in float32 once)
                        one_round = -(-n * size // 64) * 64 < eager
                        expected_eager += one_round
                        c.check(f"path_{np.dtype(dt).name}_{n}_{k}",
                                transport.stats["eager_calls"] - before == int(one_round), transport.stats)
    c.check("one_round_calls", transport.stats["eager_calls"] >= expected_eager > 0, transport.stats)
    # A strided array (not C-contiguous) takes the one-round path too, summed as its C-order copy.
    for n in (3, 1001):
        def strided(n=n):
            ctx = cudist.get_replica_context()
            return ctx.all_reduce("sum", np.repeat(values(ctx.replica_id_in_sync_group, np.float32, n, 5), 2)[::2])

        before = transport.stats["eager_calls"]
        got, want = mw.run(strided), ref.run(strided)
        ok, why = same(mw.experimental_local_results(got)[0], ref.experimental_local_results(want)[rank], True)
        c.check(f"strided_{n}", ok, why)
        c.check(f"path_strided_{n}", transport.stats["eager_calls"] - before == 1, transport.stats)
    report(rank, c.results)


def shm_small_failing(mode):
    """Worker 1 waits inside the one-round C++ call for worker 0 (which comes 3 s late) and is killed there
    (``kill``: SIGKILL) or interrupted (``sigint``: SIGINT, which must reach Python: the wait returns to the
    communicator's poll every few microseconds). The job must end at once, naming worker 1."""
    import signal
    import threading

    rank, _ = _rank_size()
    strategy = cudist.MultiWorkerMirroredStrategy()
    assert _shm_transport(strategy) is not None, "the shared-memory transport is not in use"
    step = lambda: cudist.get_replica_context().all_reduce("sum", np.ones(1000, np.float32))  # noqa: E731
    strategy.run(step)
    print(f"READY {rank} {time.time():.3f}", flush=True)
    if rank == 0:
        time.sleep(3)
    else:
        sig = signal.SIGKILL if mode == "kill" else signal.SIGINT
        threading.Timer(0.5, os.kill, (os.getpid(), sig)).start()
    strategy.run(step)
    print(f"UNREACHABLE {rank}", flush=True)


def shm_mismatch(case):
    """Workers whose calls take different paths (one node) get ReplicaMismatchError, never a hang: float32 on
    worker 0 (shared memory) against uint8 on worker 1 (MPI: not a kernel dtype), or 4 KiB (one round) against
    400 KB (the reduce-scatter, which would first grow the window)."""
    rank, _ = _rank_size()
    mw = cudist.MultiWorkerMirroredStrategy()
    if case == "dtype":
        x = np.ones(8, np.float32) if rank == 0 else np.ones(8, np.uint8)
    else:
        x = np.ones(1000 if rank == 0 else 100000, np.float32)
    try:
        mw.run(lambda: cudist.get_replica_context().all_reduce("sum", x))
        print(f"NO ERROR {rank}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"RAISED {rank} {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)


class _Stuck:
    """A kernel backend whose reduce never returns, or raises: a worker failing inside the shared-memory protocol."""

    def __init__(self, backend, mode):
        self._backend, self._mode = backend, mode

    def computes(self, dtype):
        return self._backend.computes(dtype)

    @property
    def trusted(self):
        return self

    def reduce_to_one(self, *args):
        if self._mode == "shm_hang":
            time.sleep(60)
        if self._mode == "shm_kill":
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        raise ZeroDivisionError("worker 1 fails on purpose inside the shared-memory protocol")


def shm_failing(mode, n):
    """Worker 1 hangs, is killed or raises inside the shared-memory protocol (after copying its data in),
    in an all-reduce of ``n`` float32 (small: the one-round path; large: the reduce-scatter)."""
    rank, _ = _rank_size()
    options = cudist.experimental.CommunicationOptions(timeout_seconds=2 if mode == "shm_hang" else None)
    strategy = cudist.MultiWorkerMirroredStrategy(communication_options=options)
    transport = _shm_transport(strategy)
    assert transport is not None, "the shared-memory transport is not in use"
    strategy.run(lambda: cudist.get_replica_context().all_reduce("sum", np.ones(n, np.float32)))
    print(f"READY {rank} {time.time():.3f}", flush=True)
    if rank == 1:
        transport._kernels = _Stuck(transport._kernels, mode)  # private-read: the test's fault injection
    for _ in range(2):  # the one-round path needs nothing of worker 1 after its arrival: the next call does
        strategy.run(lambda: cudist.get_replica_context().all_reduce("sum", np.ones(n, np.float32)))
    print(f"UNREACHABLE {rank}", flush=True)


def pipeline_failing(mode, pipelined):
    """Worker 1 raises, is killed or hangs inside the shared-memory protocol during a pipelined
    ``apply_gradients`` (four packs on the reduce-scatter; ``pipelined`` "off": the same step unpipelined,
    the reference for the error the job ends with)."""
    from cudist import _settings, optimizers

    rank, _ = _rank_size()
    options = cudist.experimental.CommunicationOptions(timeout_seconds=2 if mode == "shm_hang" else None,
                                                       bytes_per_pack=200_000)
    with _settings.overridden(_settings.PIPELINE_UPDATE, pipelined):
        strategy = cudist.MultiWorkerMirroredStrategy(communication_options=options)
    transport = _shm_transport(strategy)
    assert transport is not None, "the shared-memory transport is not in use"
    with strategy.scope():
        vs = [cudist.Variable(np.zeros(50_000, np.float32)) for _ in range(4)]
        opt = optimizers.Adam(0.01)

    def step():
        opt.apply_gradients([(np.ones(50_000, np.float32), v) for v in vs])

    strategy.run(step)
    ops = strategy.extended._cross_device_ops  # private-read: the test checks the step ran pipelined
    assert ops.pipelined_calls == (1 if pipelined == "on" else 0), ops.pipelined_calls
    print(f"READY {rank} {time.time():.3f}", flush=True)
    if rank == 1:
        transport._kernels = _Stuck(transport._kernels, mode)  # private-read: the test's fault injection
    for _ in range(2):
        strategy.run(step)
    print(f"UNREACHABLE {rank}", flush=True)


def exiting(mode):
    """Worker 1 ends in a way the strategy's exception hook does not see, while worker 0 goes on to
    a collective worker 1 will never make: the job must end at once, naming worker 1.

    ``early``: raises before any strategy exists; ``alone``: its TF_CONFIG is a one-worker cluster;
    ``exit3`` / ``exit0``: ``sys.exit(3)`` / ``sys.exit(0)`` after a first step; ``os_exit0``:
    ``os._exit(0)`` after a first step; ``return``: its
    script ends after a first step; ``term``: SIGTERM after a first step. ``finish``: a job that
    must succeed: worker 1 ends first with nothing owed, worker 0 works on without collectives.
    """
    rank = int(os.environ.get("PMI_RANK", "0"))
    if rank == 1 and mode == "early":
        raise ZeroDivisionError("worker 1 fails before its strategy")
    if rank == 1 and mode == "alone":
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker", "index": 0}})
    strategy = cudist.MultiWorkerMirroredStrategy()
    print(f"READY {rank} {time.time():.3f}", flush=True)

    def step():
        return strategy.run(lambda: cudist.get_replica_context().all_reduce("sum", np.ones(4, np.float32)))

    step()
    if rank == 1:
        if mode == "exit3":
            sys.exit(3)
        if mode == "exit0":
            sys.exit(0)
        if mode == "os_exit0":
            sys.stdout.flush()
            os._exit(0)  # no atexit, no MPI_Finalize: mpiexec kills worker 0 and returned 0
        if mode in ("return", "finish"):
            return
        if mode == "term":
            import signal

            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
    if mode == "finish":
        time.sleep(1.5)  # worker 1 has long reached its exit by now
        print(f"FINISHED {rank}", flush=True)
        return
    step()
    print(f"UNREACHABLE {rank}", flush=True)


def checkpoint(mode, directory):
    """A metric (sync-on-read state, read with a collective) and a variable saved mid-training.

    ``tutorial``: as TF's multi-worker tutorial (a manager per worker, non-chiefs in a temporary
    directory they remove). ``all``: every worker calls ``save`` (the README, as TF): the saved metric is the job's, the
    next step's all-reduce is right, and every worker restores the job's metric. ``chief``: only the
    chief calls ``save``: its metric read must not pair with worker 1's next all-reduce (that gave
    worker 1 3.0 instead of 2.0): a ReplicaMismatchError on both workers.
    """
    from cudist import metrics, train

    rank, W = _rank_size()
    strategy = cudist.MultiWorkerMirroredStrategy()
    with strategy.scope():
        mean = metrics.Mean()
        v = cudist.Variable(np.zeros(2, np.float32))
    ckpt = train.Checkpoint(metric=mean, v=v)

    def step():
        def fn():
            mean.update_state(np.float32(rank + 1))
            return cudist.get_replica_context().all_reduce("sum", np.ones(1, np.float32))

        return float(strategy.experimental_local_results(strategy.run(fn))[0][0])

    first = step()
    try:
        if mode == "tutorial":
            # TF's multi-worker custom-training-loop tutorial: every worker saves through a manager,
            # a non-chief into a temporary directory (workertemp_<id>) it then removes.
            import shutil

            write_dir = directory if strategy.extended.should_checkpoint else os.path.join(
                directory, f"workertemp_{rank}", "ckpt")  # fmt: skip
            os.makedirs(os.path.dirname(write_dir), exist_ok=True)
            manager = train.CheckpointManager(ckpt, directory=write_dir, max_to_keep=1)
            manager.save()
            if not strategy.extended.should_checkpoint:
                shutil.rmtree(write_dir)
            path = train.latest_checkpoint(directory) if strategy.extended.should_checkpoint else None
            path = strategy.extended._communicator.comm.bcast(path, root=0)
        elif mode == "all" or strategy.extended.should_checkpoint:
            path = ckpt.save(os.path.join(directory, "ckpt"))
        second = step()
    except Exception as e:  # noqa: BLE001 - reported in a file (two workers' long lines may interleave on stdout)
        with open(os.path.join(directory, f"error-{rank}.json"), "w") as f:
            json.dump({"error": type(e).__name__, "message": str(e)[:600]}, f)
        raise
    after_two = float(mean.result())
    with strategy.scope():
        fresh = train.Checkpoint(metric=metrics.Mean(), v=cudist.Variable(np.zeros(2, np.float32)))
    fresh.restore(path)
    report(rank, {"steps": [first, second], "after_two": after_two, "restored": float(fresh.metric.result()),
                  "files": sorted(os.listdir(directory))})


def steps():
    """Both workers train (one all-reduce every 50 ms) for up to a minute: a job to signal or kill."""
    rank, _ = _rank_size()
    strategy = cudist.MultiWorkerMirroredStrategy()
    print(f"READY {rank} {time.time():.3f}", flush=True)
    for _ in range(1200):
        strategy.run(lambda: cudist.get_replica_context().all_reduce("sum", np.ones(4, np.float32)))
        time.sleep(0.05)


def tfconfig():
    """Under ``cudist.launch --tf-config``: the default resolver reads TF_CONFIG; task index = rank."""
    rank, W = _rank_size()
    strategy = cudist.MultiWorkerMirroredStrategy()
    r = strategy.cluster_resolver
    total = strategy.run(lambda: cudist.get_replica_context().all_reduce("sum", np.float32(rank + 1)))
    out = {
        "rank": rank,
        "resolver": type(r).__name__,
        "task": [r.task_type, r.task_id],
        "workers": strategy.extended._num_workers,
        "chief": strategy.extended.should_checkpoint,
        "sum": float(total),
    }
    report(rank, out)


def gpu():
    """Under the CuPy emulation (tests/emu/fakecupy, 4 GPUs per worker): 2 workers x 2 GPU replicas
    against a MirroredStrategy over 4 GPUs: all_reduce, reduce, all_gather, Adam, a dataset."""
    import cupy as cp

    rank, _ = _rank_size()
    mw = cudist.MultiWorkerMirroredStrategy(devices=["/gpu:0", "/gpu:1"])
    ref = cudist.MirroredStrategy(["/gpu:0", "/gpu:1", "/gpu:2", "/gpu:3"])
    mine = [rank * 2, rank * 2 + 1]
    c = Checks()

    def vals(g):
        return (np.random.default_rng(g).standard_normal(6) * 10).astype(np.float32)

    def step():
        ctx = cudist.get_replica_context()
        return ctx.all_reduce("mean", cp.asarray(vals(ctx.replica_id_in_sync_group)))

    def ar():
        a = mw.experimental_local_results(mw.run(step))
        b = ref.experimental_local_results(ref.run(step))
        c.check("gpu_all_reduce", all(np.allclose(cp.asnumpy(a[i]), cp.asnumpy(b[mine[i]])) for i in range(2)))
        c.check("gpu_results_on_their_gpus", [x.device.id for x in a] == [0, 1], [str(x.device) for x in a])
        c.check("gpu_reduce", np.allclose(mw.reduce("sum", mw.run(step)), ref.reduce("sum", ref.run(step))))

    def adam():
        finals = {}
        for s in (mw, ref):
            with s.scope():
                w = cudist.Variable(np.arange(6, dtype=np.float32) + (rank if s is mw else 0))
                opt = cudist.optimizers.Adam(0.1)

            def tstep(w=w, opt=opt):
                g = cudist.get_replica_context().replica_id_in_sync_group
                opt.apply_gradients([(cp.asarray(vals(10 + g)), w)])

            for _ in range(3):
                s.run(tstep)
            finals[s is mw] = [cp.asnumpy(x) for x in s.experimental_local_results(w)]
        c.check("gpu_adam", all(np.allclose(x, finals[False][0], atol=1e-5) for x in finals[True]))

    def dataset():
        ds = data.Dataset.from_tensor_slices(np.arange(32, dtype=np.float32).reshape(16, 2)).batch(8)
        got = [[cp.asnumpy(x) for x in mw.experimental_local_results(st)] for st in mw.experimental_distribute_dataset(ds)]
        want = [[cp.asnumpy(x) for x in ref.experimental_local_results(st)] for st in ref.experimental_distribute_dataset(ds)]
        c.check("gpu_dataset", len(got) == len(want) and all(
            np.array_equal(s[i], r[mine[i]]) for s, r in zip(got, want) for i in range(2)))

    def gather():
        def g_step():
            ctx = cudist.get_replica_context()
            return ctx.all_gather(cp.full((ctx.replica_id_in_sync_group + 1, 2), ctx.replica_id_in_sync_group,
                                          cp.float32), 0)

        a = [cp.asnumpy(x) for x in mw.experimental_local_results(mw.run(g_step))]
        b = cp.asnumpy(ref.experimental_local_results(ref.run(g_step))[0])
        c.check("gpu_all_gather", all(np.array_equal(x, b) for x in a), [x.shape for x in a])

    for name, fn in (("ar", ar), ("adam", adam), ("dataset", dataset), ("gather", gather)):
        c.run(name, fn)
    report(rank, c.results)


def nccl(R):
    """Under the CuPy emulation (W*R emulated GPUs per process): W workers x R GPU replicas with
    CommunicationImplementation.NCCL against a MirroredStrategy over W*R GPUs in this process:
    all_reduce SUM/MEAN (every NCCL dtype, nests mixing host and GPU values, bytes_per_pack),
    reduce, optimizer steps; NCCL really carried them (the fake counts its cross-process calls) and
    RING did not use it; debug-mode and unchecked mismatches are errors naming the workers."""
    import cupy as cp
    from cupy.cuda import nccl as fake_nccl

    rank, W = _rank_size()
    G = W * R
    CO, CI = cudist.experimental.CommunicationOptions, cudist.experimental.CommunicationImplementation
    exact = R == 1 and W == 2  # the local sum is a copy and NCCL's one addition is MirroredStrategy's
    gpus = [f"/gpu:{i}" for i in range(R)]
    mw = cudist.MultiWorkerMirroredStrategy(communication_options=CO(implementation=CI.NCCL), devices=gpus)
    ref = cudist.MirroredStrategy([f"/gpu:{i}" for i in range(G)])
    mine = [rank * R + r for r in range(R)]
    c = Checks()
    calls = fake_nccl.EMU_CALLS
    c.check("uses_nccl", mw.extended._cross_device_ops.gpu_implementation == "NCCL", mw.extended._cross_device_ops)

    def host(x):
        return cp.asnumpy(x) if isinstance(x, cp.ndarray) else np.asarray(x)

    def compare(name, got, want_all, exact_=None, on_gpu=True):
        got = mw.experimental_local_results(got)
        want = [ref.experimental_local_results(want_all)[g] for g in mine]
        for r, (a, b) in enumerate(zip(got, want)):
            if on_gpu and not (isinstance(a, cp.ndarray) and a.device.id == r):
                c.check(name, False, f"replica {mine[r]}: {type(a).__name__} not on its GPU {r}")
                return
            ok, why = same(host(a), host(b), exact if exact_ is None else exact_)
            if not ok:
                c.check(name, False, f"replica {mine[r]}: {why}")
                return
        c.check(name, True)

    def values(g, dt, shape=(5, 3)):
        rng = np.random.default_rng(100 + g)
        if np.dtype(dt).kind in "iu":
            return cp.asarray(rng.integers(-50, 50, shape).astype(dt))
        return cp.asarray((rng.standard_normal(shape) * 10).astype(dt))

    def ar():
        for dt in (np.float32, np.float64, np.float16, np.int32, np.int64):
            for op in ("sum", "mean"):

                def step(dt=dt, op=op):
                    ctx = cudist.get_replica_context()
                    return ctx.all_reduce(op, values(ctx.replica_id_in_sync_group, dt))

                before = calls["allReduce"]
                compare(f"all_reduce_{op}_{np.dtype(dt).name}", mw.run(step), ref.run(step))
                c.check(f"all_reduce_{op}_{np.dtype(dt).name}_by_nccl", calls["allReduce"] == before + 1,
                        calls["allReduce"] - before)

    def bf16():
        """bfloat16 rides NCCL natively (NCCL >= 2.10, one call per op): each worker's replicas
        summed in float32 and rounded once, NCCL adding the workers' sums in bfloat16. Against the
        reference (every replica summed in float32, one rounding): bit-exact for 2x1 (NCCL's one
        addition of two bfloat16 values is that rounding; MEAN divides by a power of two), else
        within the documented bound (docs/guides/multi-worker.md) plus the reference's own rounding."""
        import ml_dtypes

        bf = np.dtype(ml_dtypes.bfloat16)
        shape = (37,)
        absum = sum(np.abs(host(values(g, bf, shape)).astype(np.float64)) for g in range(G))
        for op in ("sum", "mean"):

            def step(op=op):
                ctx = cudist.get_replica_context()
                return ctx.all_reduce(op, values(ctx.replica_id_in_sync_group, bf, shape))

            before = calls["allReduce"]
            got, want = mw.experimental_local_results(mw.run(step)), ref.experimental_local_results(ref.run(step))
            c.check(f"bfloat16_{op}_by_nccl", calls["allReduce"] == before + 1, calls["allReduce"] - before)
            # The guide's bound of each side against the exact sum, W * u and u (u = 2**-8), with room
            # for the second-order terms and the float32 accumulation.
            bound = 1.1 * (W + 1) * 2.0**-8 * absum / (G if op == "mean" else 1)
            for r, a in enumerate(got):
                g_arr, w_arr = host(a), host(want[mine[r]])
                if not (isinstance(a, cp.ndarray) and a.dtype == bf and a.device.id == r):
                    c.check(f"bfloat16_{op}", False, f"replica {mine[r]}: {type(a).__name__} {a.dtype} not on GPU {r}")
                    break
                if exact:
                    ok = np.array_equal(g_arr.view(np.uint16), w_arr.view(np.uint16))
                else:
                    err = np.abs(g_arr.astype(np.float64) - w_arr.astype(np.float64))
                    ok = bool(np.all(err <= bound)) and not np.array_equal(bound, 0 * bound)
                if not ok:
                    c.check(f"bfloat16_{op}", False, f"replica {mine[r]}: {g_arr[:4]} vs {w_arr[:4]}")
                    break
            else:
                c.check(f"bfloat16_{op}", True)

    def nest_step():
        ctx = cudist.get_replica_context()
        g = ctx.replica_id_in_sync_group
        return ctx.all_reduce("sum", {"a": values(g, np.float32, (7,)), "b": (np.float32(g), values(g, np.int32, (2, 2))),
                                      "c": values(g, np.float32, (300,))})

    def nest():
        before = calls["allReduce"]
        got, want = mw.run(nest_step), ref.run(nest_step)
        c.check("nest_packs", calls["allReduce"] == before + 2, calls["allReduce"] - before)  # float32 + int32
        for key in ("a", "c"):
            compare(f"nest_{key}", got[key], want[key])
        compare("nest_host_scalar_over_mpi", got["b"][0], want["b"][0], on_gpu=False)
        compare("nest_int", got["b"][1], want["b"][1])
        packed = cudist.MultiWorkerMirroredStrategy(
            communication_options=CO(bytes_per_pack=64, implementation=CI.NCCL), devices=gpus)
        before = calls["allReduce"]
        got = packed.run(nest_step)
        # float32: a (28 bytes) and c (1200 bytes) in two packs of <= 64 bytes each where possible; int32: one.
        c.check("bytes_per_pack_packs", calls["allReduce"] == before + 3, calls["allReduce"] - before)
        compare("bytes_per_pack_c", got["c"], want["c"])
        compare("bytes_per_pack_a", got["a"], want["a"])

    def reduce():
        for axis in (None, 0):
            for op in ("sum", "mean"):
                def shape_of(g):
                    return (g + 1, 3) if axis == 0 else (4, 3)

                def per_replica(strategy):
                    return strategy.experimental_distribute_values_from_function(
                        lambda vc: values(vc.replica_id_in_sync_group, np.float32, shape_of(vc.replica_id_in_sync_group)))

                a, b = mw.reduce(op, per_replica(mw), axis=axis), ref.reduce(op, per_replica(ref), axis=axis)
                c.check(f"reduce_{op}_axis{axis}", *same(host(a), host(b), exact))

    def optimizers():
        for name, make_opt in (
            ("sgd_momentum", lambda: cudist.optimizers.SGD(0.1, momentum=0.9)),
            ("adam", lambda: cudist.optimizers.Adam(0.01)),
        ):
            finals = []
            before = calls["allReduce"]
            for strategy in (mw, ref):
                with strategy.scope():
                    w = cudist.Variable(np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8) + (rank if strategy is mw else 0))
                    b = cudist.Variable(np.zeros(8, np.float32))
                    opt = make_opt()

                def train_step(it, w=w, b=b, opt=opt):
                    g = cudist.get_replica_context().replica_id_in_sync_group
                    opt.apply_gradients([(values(10 * it + g, np.float32, (8, 8)), w), (values(10 * it + g + 5, np.float32, (8,)), b)])

                for it in range(3):
                    strategy.run(train_step, args=(it,))
                finals.append(([host(x) for x in strategy.experimental_local_results(w)],
                               [host(x) for x in strategy.experimental_local_results(b)]))
            (wm, bm), (wr, br) = finals
            ok = all(same(x, wr[g], exact)[0] for x, g in zip(wm, mine)) and all(same(x, br[g], exact)[0] for x, g in zip(bm, mine))
            c.check(f"optimizer_{name}", ok, f"{wm[0].ravel()[:3]} vs {wr[mine[0]].ravel()[:3]}")
            c.check(f"optimizer_{name}_by_nccl", calls["allReduce"] >= before + 3, calls["allReduce"] - before)

    def gather():
        def g_step():
            ctx = cudist.get_replica_context()
            g = ctx.replica_id_in_sync_group
            return ctx.all_gather(cp.full((g + 1, 2), g, cp.float32), 0)

        compare("all_gather_over_mpi", mw.run(g_step), ref.run(g_step), True)

    def ring():
        ringed = cudist.MultiWorkerMirroredStrategy(communication_options=CO(implementation=CI.RING), devices=gpus)
        c.check("ring_is_mpi", ringed.extended._cross_device_ops.gpu_implementation == "MPI", ringed.extended._cross_device_ops)

        def step():
            ctx = cudist.get_replica_context()
            return ctx.all_reduce("sum", values(ctx.replica_id_in_sync_group, np.float32))

        before = dict(calls)
        compare("ring_all_reduce", ringed.run(step), ref.run(step))
        c.check("ring_no_nccl", dict(calls) == before, (before, dict(calls)))

    def checked():
        os.environ["CUDIST_CHECK_COLLECTIVES"] = "1"
        s = cudist.MultiWorkerMirroredStrategy(communication_options=CO(implementation=CI.NCCL), devices=gpus)
        del os.environ["CUDIST_CHECK_COLLECTIVES"]
        s.run(lambda: cudist.get_replica_context().all_reduce("sum", cp.ones(3, cp.float32)))  # the communicator
        try:
            s.run(lambda: cudist.get_replica_context().all_reduce("sum", cp.ones(3 + rank, cp.float32)))
            c.check("checked_mismatch", False, "no error")
        except Exception as e:  # noqa: BLE001
            msg = str(e)
            c.check("checked_mismatch", type(e).__name__ == "ReplicaMismatchError" and "all_reduce SUM (NCCL)" in msg
                    and "float32(3,)" in msg and "float32(4,)" in msg, msg)

    def default_check():
        """The default check (a hash riding with each call) catches the mismatch before NCCL is called."""
        s = cudist.MultiWorkerMirroredStrategy(communication_options=CO(implementation=CI.NCCL), devices=gpus)
        s.run(lambda: cudist.get_replica_context().all_reduce("sum", cp.ones(3, cp.float32)))  # the communicator
        try:
            s.run(lambda: cudist.get_replica_context().all_reduce("sum", cp.ones(3 + rank, cp.float32)))
            c.check("default_check_mismatch", False, "no error")
        except Exception as e:  # noqa: BLE001
            msg = str(e)
            c.check("default_check_mismatch", type(e).__name__ == "ReplicaMismatchError"
                    and "all_reduce SUM (NCCL)" in msg and "float32(3,)" in msg and "float32(4,)" in msg, msg)

    def unchecked():
        """Last, with the checks off (CUDIST_CHECK_COLLECTIVES=0): the mismatched NCCL call stays
        stuck on the stream, as on a GPU, until the fake reports it."""
        os.environ["CUDIST_CHECK_COLLECTIVES"] = "0"
        s = cudist.MultiWorkerMirroredStrategy(communication_options=CO(implementation=CI.NCCL), devices=gpus)
        del os.environ["CUDIST_CHECK_COLLECTIVES"]
        s.run(lambda: cudist.get_replica_context().all_reduce("sum", cp.ones(3, cp.float32)))  # the communicator
        try:
            s.run(lambda: cudist.get_replica_context().all_reduce("sum", cp.ones(3 + rank, cp.float32)))
            c.check("unchecked_mismatch", False, "no error")
        except Exception as e:  # noqa: BLE001
            msg = str(e)
            c.check("unchecked_mismatch", type(e).__name__ == "InternalError" and f"worker {rank} of {W}" in msg
                    and "NcclError" in msg and "rank 1" in msg, msg)

    for name, fn in (("ar", ar), ("bf16", bf16), ("nest", nest), ("reduce", reduce), ("optimizers", optimizers), ("gather", gather),
                     ("ring", ring), ("checked", checked), ("default_check", default_check),
                     ("unchecked", unchecked)):
        c.run(name, fn)
    report(rank, c.results)


def nccl_failing(mode):
    """A worker that raises or is killed while the other waits in an NCCL all-reduce, an NCCL error in
    worker 1 (the fake's CUDIST_EMU_NCCL_FAIL), or a worker that hangs after the NCCL communicator exists."""
    import cupy as cp

    rank, _ = _rank_size()
    CO, CI = cudist.experimental.CommunicationOptions, cudist.experimental.CommunicationImplementation
    options = CO(timeout_seconds=2 if mode == "nccl_hang" else None, implementation=CI.NCCL)
    strategy = cudist.MultiWorkerMirroredStrategy(communication_options=options, devices=["/gpu:0"])

    def step():
        return strategy.run(lambda: cudist.get_replica_context().all_reduce("sum", cp.ones(4, cp.float32)))

    if mode != "nccl_fail":
        step()  # the NCCL communicator exists: what follows happens inside NCCL
    print(f"READY {rank} {time.time():.3f}", flush=True)
    if rank == 1:
        if mode == "nccl_raise":
            time.sleep(0.5)  # worker 0 is waiting in the NCCL all-reduce by now
            raise ZeroDivisionError("worker 1 fails on purpose")
        if mode == "nccl_hang":
            time.sleep(60)
        if mode == "nccl_kill":
            import signal

            time.sleep(0.5)  # worker 0 is waiting in the NCCL all-reduce by now
            os.kill(os.getpid(), signal.SIGKILL)
    step()
    print(f"UNREACHABLE {rank}", flush=True)


def nccl_auto():
    """CommunicationImplementation.AUTO on GPU workers: NCCL when CuPy loads it, else MPI (CUDIST_EMU_NCCL=0)."""
    import cupy as cp

    rank, W = _rank_size()
    mw = cudist.MultiWorkerMirroredStrategy(devices=["/gpu:0"])
    out = mw.run(lambda: cudist.get_replica_context().all_reduce("sum", cp.full(3, rank + 1, cp.float32)))
    report(rank, {"implementation": mw.extended._cross_device_ops.gpu_implementation,
                  "sum": cp.asnumpy(out).tolist(), "on_gpu": isinstance(out, cp.ndarray)})


def mixed(R):
    """bfloat16 across workers and LossScaleOptimizer skips (issue 28), against a MirroredStrategy over
    all W*R replicas in this process: bfloat16 results bit for bit (every worker sums every replica in
    float32 in worker order); the loss-scale trajectory with an inf on one worker only."""
    import ml_dtypes

    from cudist import optimizers

    bf16 = np.dtype(ml_dtypes.bfloat16)
    rank, W = _rank_size()
    G = W * R
    cpu = cudist.config.list_physical_devices("CPU")[0]
    cudist.config.set_logical_device_configuration(cpu, [cudist.config.LogicalDeviceConfiguration()] * G)
    mw = cudist.MultiWorkerMirroredStrategy(devices=[f"/cpu:{i}" for i in range(R)])
    ref = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(G)])
    mine = [rank * R + r for r in range(R)]
    c = Checks()

    def local(strategy, x):
        return strategy.experimental_local_results(x)

    def compare(name, got, want_all, exact=True):
        got = local(mw, got)
        want = [local(ref, want_all)[g] for g in mine]
        for r, (a, b) in enumerate(zip(got, want)):
            a, b = np.asarray(a), np.asarray(b)
            if a.dtype == bf16 and b.dtype == bf16:  # bits, NaN payloads and signed zeros included
                ok, why = a.shape == b.shape and np.array_equal(a.view(np.uint16), b.view(np.uint16)), ""
                why = "" if ok else f"{a.ravel()[:6]} vs {b.ravel()[:6]}"
            else:
                ok, why = same(a, b, exact)
            if not ok:
                c.check(name, False, f"replica {mine[r]}: {why}")
                return
        c.check(name, True)

    def values(g, size):
        rng = np.random.default_rng(300 + g)
        # Mixed magnitudes: rounding after every addition (or summing per worker first) gives other bits.
        return (rng.standard_normal(size) * 10.0 ** rng.integers(-3, 3, size)).astype(bf16)

    for size in (1, 7, 1001):
        for op in ("sum", "mean"):

            def step(size=size, op=op):
                ctx = cudist.get_replica_context()
                return ctx.all_reduce(op, values(ctx.replica_id_in_sync_group, size))

            compare(f"bf16_all_reduce_{op}_{size}", mw.run(step), ref.run(step))

    def f16_step():  # float16 too: float32 accumulation over every replica, one rounding (bits compared)
        ctx = cudist.get_replica_context()
        return ctx.all_reduce("sum", values(ctx.replica_id_in_sync_group, 1001).astype(np.float32).astype(np.float16))

    got = [np.asarray(x).view(np.uint16) for x in local(mw, mw.run(f16_step))]
    want = [np.asarray(local(ref, ref.run(f16_step))[g]).view(np.uint16) for g in mine]
    c.check("f16_all_reduce_bits", all(np.array_equal(a, b) for a, b in zip(got, want)), "")

    def nest_step():
        ctx = cudist.get_replica_context()
        g = ctx.replica_id_in_sync_group
        return ctx.all_reduce("sum", {"a": values(g, 5), "b": np.float32(g + 0.5), "c": values(g + 7, 300).reshape(30, 10)})

    got, want = mw.run(nest_step), ref.run(nest_step)
    for key in ("a", "b", "c"):
        compare(f"bf16_nest_{key}", got[key], want[key], exact=R == 1 and W == 2)

    def per_replica():
        return values(cudist.get_replica_context().replica_id_in_sync_group, 33)

    for op in ("sum", "mean"):
        a = mw.reduce(op, mw.run(per_replica), axis=None)
        b = ref.reduce(op, ref.run(per_replica), axis=None)
        ok = np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
        c.check(f"bf16_strategy_reduce_{op}", ok, f"{np.asarray(a)[:4]} vs {np.asarray(b)[:4]}")

    # bfloat16 gradients into float32 variables: cast exactly, summed in float32 across the workers.
    def train(strategy):
        with strategy.scope():
            w = cudist.Variable(np.linspace(-1, 1, 9, dtype=np.float32), name="w")
            opt = optimizers.SGD(0.25, momentum=0.5)

        def fn():
            opt.apply_gradients([(values(cudist.get_replica_context().replica_id_in_sync_group, 9), w)])

        for _ in range(3):
            strategy.run(fn)
        return np.asarray(w.numpy())

    ok, why = same(train(mw), train(ref), R == 1 and W == 2)
    c.check("bf16_grads_float32_variables", ok, why)

    # LossScaleOptimizer: an inf or NaN on one worker's replica only; every worker skips those steps.
    schedule = {1: ("inf", W - 1), 2: ("nan", 0), 4: ("inf", W - 1)}  # step -> (bad value, worker)

    def loss_scale(strategy):
        with strategy.scope():
            w = cudist.Variable(np.array([1.0, -2.0, 0.5], np.float32), name="w")
            opt = optimizers.LossScaleOptimizer(optimizers.SGD(0.5), initial_scale=8.0, dynamic_growth_steps=2)
        trace = []
        for step in range(7):

            def fn(step=step):
                g = cudist.get_replica_context().replica_id_in_sync_group
                grad = np.array([g + 1.0, -0.5, 0.25], np.float32) * np.float32(step + 1)
                bad = schedule.get(step)
                if bad and g == bad[1] * R:  # the first replica of that worker
                    grad[1] = np.float32(bad[0])
                opt.apply_gradients([(grad, w)])

            strategy.run(fn)
            trace.append([float(np.asarray(opt.dynamic_scale.read_value())), int(np.asarray(opt.iterations.read_value())),
                          np.asarray(w.numpy()).tolist()])
        return trace

    got_trace, want = loss_scale(mw), loss_scale(ref)
    skips = [i for i in range(1, len(want)) if want[i][1] == want[i - 1][1]]
    c.check("loss_scale_skips", [t[:2] for t in got_trace] == [t[:2] for t in want] and skips == sorted(schedule),
            f"{[t[:2] for t in got_trace]} vs {[t[:2] for t in want]}; skipped steps {skips}")
    ok, why = same(np.array([t[2] for t in got_trace], np.float32), np.array([t[2] for t in want], np.float32),
                   R == 1 and W == 2)
    c.check("loss_scale_variables", ok, why)

    # CommunicationOptions(compression=...): float32 across the workers in 16 bits, summed in float32.
    def fvalues(g, size=1001):
        rng = np.random.default_rng(500 + g)
        return (rng.standard_normal(size) * 10.0 ** rng.integers(-3, 3, size)).astype(np.float32)

    partial = []  # each worker's float32 partial sum, replica order
    for w in range(W):
        s = fvalues(w * R)
        for r in range(1, R):
            s = s + fvalues(w * R + r)
        partial.append(s)
    exact_sum = np.sum([p.astype(np.float64) for p in partial], axis=0)
    magnitude = np.sum([np.abs(p.astype(np.float64)) for p in partial], axis=0)

    def fstep():
        ctx = cudist.get_replica_context()
        return ctx.all_reduce("sum", fvalues(ctx.replica_id_in_sync_group))

    plain = np.asarray(local(mw, mw.run(fstep))[0])
    squeezed = {}
    for comp, u, e in (("bfloat16", 2.0**-8, 2.0**-134), ("float16", 2.0**-11, 2.0**-25)):
        mwc = cudist.MultiWorkerMirroredStrategy(
            communication_options=cudist.experimental.CommunicationOptions(compression=comp),
            devices=[f"/cpu:{i}" for i in range(R)],
        )
        got = [np.asarray(x) for x in local(mwc, mwc.run(fstep))]
        err = np.abs(got[0].astype(np.float64) - exact_sum)
        bound = (u + W * 2.0**-24) * magnitude + W * e
        ok = all(x.dtype == np.float32 and np.array_equal(x, got[0]) for x in got) and bool(np.all(err <= bound))
        c.check(f"compression_{comp}_bound", ok, f"worst error/bound {np.max(err / bound):.3g}")
        # It did compress: the result is not the exact float32 one (rounding to 16 bits shows).
        c.check(f"compression_{comp}_differs", not np.array_equal(got[0], plain), "equal to the uncompressed sum")
        mean = np.asarray(local(mwc, mwc.run(lambda: cudist.get_replica_context().all_reduce(
            "mean", fvalues(cudist.get_replica_context().replica_id_in_sync_group))))[0])
        c.check(f"compression_{comp}_mean", np.array_equal(mean, got[0] / np.float32(G)), "")
        squeezed[comp] = got[0].view(np.uint32).tolist()[:50]
    report(rank, {"results": c.results, "trace": [t[:2] for t in got_trace], "squeezed": squeezed})


if __name__ == "__main__":
    if sys.argv[1] == "parity":
        parity(int(sys.argv[2]), sys.argv[3:] == ["exact"])
    elif sys.argv[1] == "shm_mismatch":
        shm_mismatch(sys.argv[2])
    elif sys.argv[1] == "shm_train":
        shm_train()
    elif sys.argv[1] == "shm_model":
        shm_model()
    elif sys.argv[1] == "shm":
        shm(sys.argv[2] == "exact")
    elif sys.argv[1] == "pipeline":
        pipeline(int(sys.argv[2]))
    elif sys.argv[1] == "shm_small":
        shm_small()
    elif sys.argv[1] == "pipeline_failing":
        pipeline_failing(sys.argv[2], sys.argv[3])
    elif sys.argv[1].startswith("shm_small_"):
        shm_small_failing(sys.argv[1][len("shm_small_"):])
    elif sys.argv[1].startswith("shm_"):
        shm_failing(sys.argv[1], int(sys.argv[2]))
    elif sys.argv[1].startswith("exit:"):
        exiting(sys.argv[1][5:])
    elif sys.argv[1] == "checkpoint":
        checkpoint(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "steps":
        steps()
    elif sys.argv[1] == "tfconfig":
        tfconfig()
    elif sys.argv[1] == "gpu":
        gpu()
    elif sys.argv[1] == "nccl":
        nccl(int(sys.argv[2]))
    elif sys.argv[1] == "mixed":
        mixed(int(sys.argv[2]))
    elif sys.argv[1] == "nccl_auto":
        nccl_auto()
    elif sys.argv[1].startswith("nccl_"):
        nccl_failing(sys.argv[1])
    else:
        failing(sys.argv[1])
