"""The short paths of ``strategy.run`` and ``ReplicaContext.all_reduce`` give what the general
paths give: ``select_replicas`` against ``select_replica`` per replica, and the one-array-per-replica
all-reduce against the nest path, on the inputs each short path hands over to the general one."""

from __future__ import annotations

import numpy as np
import pytest

import cudist
from cudist._values import Mirrored, PerReplica, regroup, select_replica, select_replicas, select_replicas_exact


def _same(a, b):
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a is b


@pytest.fixture
def mirrored3():
    return cudist.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])


def test_select_replicas_equals_select_replica_per_replica(mirrored3):
    n = 3
    arrs = [np.full(2, i, np.float32) for i in range(n)]
    pr = PerReplica(arrs)
    mir = Mirrored([np.ones(1)] * n)
    with mirrored3.scope():
        var = cudist.Variable(np.zeros(2, np.float32))  # kept whole: it picks its own component
    plain = np.arange(3.0)
    for structured in [
        (pr,), (pr, plain), (plain,), (pr, mir, var), (), (pr, 1.5), (pr, (plain, pr)),
        {"x": pr, "y": plain}, [pr, plain], pr, var, None, plain,
        ([pr, plain], (pr, [mir, var]), []), ([pr] * 4, ()), ([[pr], (plain,)],), ([pr, {"k": pr}],),
    ]:
        got = select_replicas(n, structured)
        want = [select_replica(i, structured) for i in range(n)]
        assert len(got) == n
        assert all(_same(g, w) for g, w in zip(got, want)), structured


def test_select_replicas_gives_every_replica_containers_of_its_own():
    n = 3
    pr = PerReplica([np.full(2, i, np.float32) for i in range(n)])
    plain = np.arange(3.0)
    got = select_replicas(n, ([plain, plain], [pr, (plain, [])]))
    for i, (same, mixed) in enumerate(got):
        assert type(same) is list and same[0] is plain and type(mixed[1]) is tuple and mixed[1][1] == []
        assert mixed[0] is pr.values[i]
    # a replica that appends to its list must not change another replica's
    assert len({id(r[0]) for r in got}) == n and len({id(r[1][1][1]) for r in got}) == n


def test_regroup_of_no_keyword_arguments_is_an_empty_dict():
    """merge_call's keyword arguments when no replica passes any: the short path gives what the
    nest path gives, a new empty dict each time."""
    got = regroup([{}, {}, {}])
    assert got == {} and type(got) is dict
    assert regroup([{}, {}]) is not regroup([{}, {}])
    with pytest.raises(ValueError, match="differs"):
        regroup([{}, {"a": np.ones(1)}])


@pytest.mark.parametrize("container", [list, tuple])
@pytest.mark.parametrize("always_wrap", [False, True])
def test_regroup_of_flat_lists_of_arrays_equals_the_nest_path(container, always_wrap):
    """run()'s results as a flat list or tuple of arrays (the short path) regroup as the same values
    inside a dict (the tree walk) do: the same object from every replica unwrapped, others wrapped."""
    shared = np.ones(2)
    per = [container([np.full(3, r, np.float32), shared, np.zeros((2, 2))]) for r in range(3)]
    got = regroup(per, PerReplica, always_wrap=always_wrap)
    want = regroup([{"x": p} for p in per], PerReplica, always_wrap=always_wrap)["x"]
    assert type(got) is container and len(got) == 3
    for g, w in zip(got, want):
        assert type(g) is type(w)
        if isinstance(w, PerReplica):
            assert all(a is b for a, b in zip(g.values, w.values))
        else:
            assert g is w
    assert (got[1] is shared) is (not always_wrap)
    # nested one level (merge_call's arguments: a tuple holding the replica's gradients)
    nested = [(container([np.full(2, r), shared]), np.zeros(1) + r) for r in range(3)]
    got = regroup(nested, PerReplica, always_wrap=always_wrap)
    want = regroup([{"x": p} for p in nested], PerReplica, always_wrap=always_wrap)["x"]
    assert type(got) is tuple and type(got[0]) is container
    assert isinstance(got[1], PerReplica) and all(a is b for a, b in zip(got[1].values, want[1].values))
    assert (got[0][1] is shared) is (not always_wrap) and (want[0][1] is shared) is (not always_wrap)
    assert all(a is b for a, b in zip(got[0][0].values, want[0][0].values))
    mixed = [(np.ones(1), 3.0), (np.ones(1), 3.0)]  # a leaf that is not an array: the general path
    assert regroup(mixed)[1] == 3.0
    assert regroup([container(), container()]) == container()
    with pytest.raises(ValueError, match="differs"):
        regroup([container([np.ones(1)]), container([np.ones(1), np.ones(1)])])


def test_select_replicas_exact_selects_usual_args_and_declines_the_rest(mirrored3):
    n = 3
    pr = PerReplica([np.full(2, i, np.float32) for i in range(n)])
    mir = Mirrored([np.ones(1)] * n)
    with mirrored3.scope():
        var = cudist.Variable(np.zeros(2, np.float32))
    plain = np.arange(3.0)
    for args in [(pr,), (pr, plain), (pr, mir, var), ([pr, plain], (pr, [mir, var]), []), ([[pr], (plain,)],)]:
        got = select_replicas_exact(n, args)
        assert got is not None and all(_same(g, w) for g, w in zip(got, select_replicas(n, args))), args
    too_many, too_few = PerReplica([plain] * 4), Mirrored([plain] * 2)
    for args in [(too_many,), (plain, [too_few]), (pr, 1.5), ({"x": pr},), ((plain, (too_many,)),)]:
        assert select_replicas_exact(n, args) is None, args


def test_select_replicas_too_few_components_is_an_index_error():
    with pytest.raises(IndexError):
        select_replicas(3, (PerReplica([np.ones(1), np.ones(1)]),))


def test_run_with_too_few_components_names_the_counts(mirrored3):
    with pytest.raises(ValueError, match="2 component"):
        mirrored3.run(lambda x: x, args=(PerReplica([np.ones(1), np.ones(1)]),))


@pytest.mark.parametrize(
    "make_args",
    [
        lambda: (np.ones(1), PerReplica([np.ones(1)] * 4)),  # too many components
        lambda: (Mirrored([np.ones(1)] * 2), np.ones(1)),  # another DistributedValues
        lambda: (np.ones(1), [PerReplica([np.ones(1)] * 2)]),  # inside a nest of the tuple
        lambda: ({"a": PerReplica([np.ones(1)] * 2)},),
    ],
)
def test_run_checks_component_counts_on_every_args_path(mirrored3, make_args):
    with pytest.raises(ValueError, match=r"component\(s\), but the strategy has 3 replicas"):
        mirrored3.run(lambda *a: None, args=make_args())


def test_run_with_per_replica_args_gives_each_replica_its_component(mirrored3):
    comps = [np.full(2, float(i)) for i in range(3)]
    shared = np.ones(2)
    seen = mirrored3.experimental_local_results(
        mirrored3.run(lambda x, y: (x, y), args=(PerReplica(comps), shared))
    )
    assert all(got[0] is c and got[1] is shared for got, c in zip(seen, comps))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "float16"])
@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("size", [5, 40_000])  # per-replica pooled results; one shared result
def test_one_array_per_replica_matches_the_nest_path(mirrored3, dtype, op, size):
    rng = np.random.default_rng(size)
    base = [(rng.standard_normal(2 * size) * 100).astype(dtype) for _ in range(3)]
    views = [b[::2] for b in base]  # not contiguous: the short path must make them so
    before = [b.copy() for b in base]

    def fn(x):
        c = cudist.get_replica_context()
        return c.all_reduce(op, x), c.all_reduce(op, (x,))[0]

    short, nest = mirrored3.run(fn, args=(PerReplica(views),))
    want = views[0].astype(np.float64) + views[1] + views[2] if op == "mean" else None
    for r in range(3):
        a, b = short.values[r], nest.values[r]
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
        assert not a.flags.writeable  # results are immutable, as TF's tensors
        if op == "mean" and np.dtype(dtype).kind == "i":
            assert a.dtype == np.float64
            np.testing.assert_allclose(a, want / 3)
    assert all(np.array_equal(b, c) for b, c in zip(base, before)), "the inputs were changed"


def test_mixed_arrays_and_scalars_per_replica_go_the_general_way(mirrored3):
    def fn():
        c = cudist.get_replica_context()
        i = c.replica_id_in_sync_group
        x = np.float32(2.0) if i == 1 else np.array(2.0, np.float32)  # a NumPy scalar on replica 1
        return c.all_reduce("sum", x)

    out = mirrored3.run(fn)
    assert [float(v) for v in out.values] == [6.0, 6.0, 6.0]
