"""The fused update pass's table of rules (cudist._dataplane.update): every optimizer's step maps to a
row of ``UPDATE_KERNELS`` with the scalars that row names, and a bad rule is refused up front."""

from __future__ import annotations

import numpy as np
import pytest

from cudist import optimizers
from cudist._dataplane.update import Rule
from cudist._kernels import UPDATE_KERNELS

OPTIMIZERS = [
    optimizers.SGD(0.1),
    optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    optimizers.Adam(0.1),
    optimizers.Adam(0.1, amsgrad=True),
    optimizers.AdamW(0.1),
    optimizers.RMSprop(0.1),
    optimizers.RMSprop(0.1, momentum=0.5),
    optimizers.RMSprop(0.1, centered=True),
    optimizers.RMSprop(0.1, momentum=0.5, centered=True),
    optimizers.Adagrad(0.1),
    optimizers.Adamax(0.1),
    optimizers.Nadam(0.1),
    optimizers.Lion(0.1),
]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: f"{type(o).__name__}{o._slot_names}")
@pytest.mark.parametrize("decay", [0.0, 0.25])
def test_every_optimizer_step_is_a_row_of_the_table(opt, decay):
    rule = opt._rule(opt._step_params(0.1, 1), decay)
    slots, scalars = UPDATE_KERNELS[rule.kernel]
    assert rule.fused == f"all_reduce_{rule.kernel}"
    assert len(rule.scalars) == len(scalars)
    assert scalars[-1] == "decay" and rule.scalars[-1] == decay  # every row's kernel folds the decay in
    # The rule's slots are filled from the optimizer's, in the table's order (None: left out).
    order = rule.slots if rule.slots is not None else tuple(range(len(opt._slot_names)))
    assert len(order) == len(slots)
    filled = [i for i in order if i is not None]
    assert sorted(filled) == list(range(len(opt._slot_names)))
    for i, name in zip(order, slots):
        if i is not None and type(opt) is optimizers.RMSprop:
            assert opt._slot_names[i] == name


def test_rmsprop_passes_its_optional_slots_as_absent():
    rule = optimizers.RMSprop(0.1, centered=True)._rule((0.1,), 0.0)
    a, b = np.zeros(2), np.ones(2)
    assert rule._slot_args(((a,), (b,))) == ((a,), None, (b,))


def test_a_bad_rule_is_refused():
    with pytest.raises(ValueError, match="no update rule 'adamx'"):
        Rule("adamx", (0.1,))
    with pytest.raises(ValueError, match=r"update rule 'adamw' takes 4 scalars"):
        Rule("adamw", (0.1, 0.9, 0.999))
    with pytest.raises(ValueError, match=r"update rule 'lion' takes 3 scalars"):
        Rule("lion", (0.1, 0.9, 0.99, 0.0))  # the decay is not one of the scalars passed


def test_fusable_decides_from_the_plans_and_each_variables_gradient_dtype():
    """What depends on the variable alone is settled at plan time (``plan[2]``: the backend, the
    dtype, every array the update writes); ``fusable`` then checks the replica count, the plans'
    backend and each variable's gradient dtype."""
    import cudist
    from cudist._dataplane.update import UpdatePass

    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(3)
    with s.scope():
        v32 = cudist.Variable(rng.standard_normal(5).astype(np.float32))
        v64 = cudist.Variable(rng.standard_normal((2, 3)))
        slot = cudist.Variable(np.zeros(5, np.float32))
    update = UpdatePass("test")
    plans = [update.plan(v32, {"m": slot}), update.plan(v64, {})]
    for plan, var, written in zip(plans, (v32, v64), ((v32, slot), (v64,))):
        backend, dtype, arrays = plan[2]
        assert dtype == var.dtype and backend is plan[1][0][2]
        assert len(arrays) == len(written) and all(a is w.storage.buffers()[0] for a, w in zip(arrays, written))
    assert update.plan(v32, {"m": slot}) is plans[0]  # reused while the storage stays

    def grads(v, *dtypes):
        return tuple(rng.standard_normal(v.shape).astype(d) for d in dtypes)

    ok = [grads(v32, np.float32, np.float32), grads(v64, np.float64, np.float64)]
    backend = update.fusable(s, ok, plans)
    assert backend is not None and backend is plans[0][2][0]
    assert update.fusable(s, [g[:1] for g in ok], plans) is None  # one gradient for two replicas
    assert update.fusable(s, [grads(v32, np.float16, np.float32), ok[1]], plans) is None  # replicas disagree
    assert update.fusable(s, [ok[0], grads(v64, np.float32, np.float64)], plans) is None
