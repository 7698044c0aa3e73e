"""cudist.optimizers against Keras 3 (TF 2.21): trajectories and schedules recorded by
tests/data/record_keras_optimizers.py into tests/data/keras_optimizers.json.

Every case (an optimizer, its constructor arguments -- weight decay with exclusions, clipping,
schedules, EMA, loss scale, gradient accumulation --, float32 or float64 variables and six steps of
random gradients) is replayed

* ``plain``: no strategy, ``apply_gradients`` on the whole gradient (Keras's ``one`` run);
* ``one_device``: inside ``OneDeviceStrategy.run`` (the ``one`` run);
* ``mirrored2`` / ``mirrored3``: inside ``MirroredStrategy.run``, each replica applying the
  per-replica gradient Keras's replica got under ``tf.distribute.MirroredStrategy`` (they sum to
  the whole gradient; clipping applies per replica, as in Keras 3);
* ``central2``: inside ``CentralStorageStrategy.run`` on 2 compute devices (the ``mirrored2`` run),
* and (``gpu`` marker) OneDevice, Mirrored on 3 logical GPUs and CentralStorage over 2 GPU replicas,

and compared after every step to float tolerance. Keras computes scalars in float32 even for float64
variables (its learning-rate variable, schedules; a Python hyper-parameter converts through a
float32 tensor, so Adam's ``beta_2**t`` of a float64 variable uses float32(0.999)): float64 runs
agree with it to float32 precision, not to float64's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import cudist
from cudist import optimizers
from cudist.optimizers import schedules

from conftest import make_strategy, set_gpu0_split

DATA = json.loads((Path(__file__).parent / "data" / "keras_optimizers.json").read_text())
CASES = {c["name"]: c for c in DATA["cases"]}
# (cudist strategy kind, the recorded run it replays)
KINDS = [("plain", "one"), ("one_device", "one"), ("mirrored2", "mirrored2"), ("mirrored3", "mirrored3"),
         ("central2", "mirrored2")]  # fmt: skip
# The same on (logical) GPUs: the cupy backend's CUDA kernels (run under the CuPy emulation without one).
GPU_KINDS = [("one_device_gpu", "one"), ("mirrored_gpu3", "mirrored3"), ("central_gpu2", "mirrored2")]
TOL = {"float32": dict(rtol=3e-5, atol=3e-6), "float64": dict(rtol=2e-5, atol=2e-6)}


def dec(x):
    return np.array(x["data"], dtype=x["dtype"]).reshape(x["shape"])


def cudist_kwargs(kwargs):
    out = dict(kwargs)
    lr = out.get("learning_rate")
    if isinstance(lr, dict):
        out["learning_rate"] = getattr(schedules, lr["schedule"])(**lr["config"])
    return out


def test_the_data_is_keras_3_on_tf_2_21():
    assert DATA["tensorflow"].startswith("2.21") and DATA["keras"].startswith("3.")
    optimizers_covered = {c["optimizer"] for c in DATA["cases"]}
    assert optimizers_covered == {"SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "Nadam", "Lion"}
    for case in DATA["cases"]:
        for kind in ("one", "mirrored2", "mirrored3"):
            assert "error" not in case["runs"][kind], (case["name"], kind, case["runs"][kind].get("error"))


# ------------------------------------------------------------------------------------- schedules
@pytest.mark.parametrize("rec", DATA["schedules"], ids=lambda r: f"{r['class_name']}-{sorted(r['config'])}")
def test_schedule_values_follow_keras(rec):
    sched = getattr(schedules, rec["class_name"])(**rec["config"])
    got = [sched(step) for step in range(len(rec["values"]))]
    assert all(type(v) is float for v in got)
    np.testing.assert_allclose(got, rec["values"], rtol=2e-6, atol=1e-9)
    # A NumPy step (what int(optimizer.iterations) reads) gives the same.
    assert sched(np.int64(3)) == got[3]


@pytest.mark.parametrize("rec", DATA["schedules"], ids=lambda r: f"{r['class_name']}-{sorted(r['config'])}")
def test_schedule_config_and_serialization_match_keras(rec):
    sched = getattr(schedules, rec["class_name"])(**rec["config"])
    assert schedules.serialize(sched) == rec["serialized"]
    again = schedules.deserialize(rec["serialized"])
    assert type(again) is type(sched) and again.get_config() == sched.get_config()
    assert type(sched).from_config(sched.get_config()).get_config() == sched.get_config()


def test_schedule_errors_and_custom_schedules():
    with pytest.raises(ValueError, match="`decay_steps` must be > 0"):
        schedules.ExponentialDecay(0.1, 0, 0.5)
    with pytest.raises(ValueError, match="1 less than the length of values"):
        schedules.PiecewiseConstantDecay([1, 2], [0.1, 0.2])
    with pytest.raises(ValueError, match="Unknown decay"):
        schedules.deserialize({"class_name": "Nope", "config": {}})

    class Halving(schedules.LearningRateSchedule):
        def __call__(self, step):
            return 0.5 ** step

        def get_config(self):
            return {}

    ser = schedules.serialize(Halving())
    assert ser["class_name"] == "Halving"
    assert isinstance(schedules.deserialize(ser, custom_objects={"Halving": Halving}), Halving)
    with pytest.raises(NotImplementedError):
        schedules.LearningRateSchedule()(0)
    import cudist.optimizers.schedules as via_import  # the public module path imports

    assert via_import is schedules


# ------------------------------------------------------------------------------------- trajectories
def _replay(case, kind, run):
    if "_gpu" in kind:
        pytest.importorskip("cupy")
        try:
            return _replay_on(case, kind, run)
        finally:
            set_gpu0_split(None)
    return _replay_on(case, kind, run)


def _replay_on(case, kind, run):
    dtype = case["dtype"]
    strategy = None if kind == "plain" else make_strategy(kind)
    scope = strategy.scope() if strategy is not None else cudist.get_strategy().scope()
    with scope:
        variables = {k: cudist.Variable(dec(v), name=k) for k, v in case["init"].items()}
        opt = getattr(optimizers, case["optimizer"])(**cudist_kwargs(case["kwargs"]))
        if case["exclude"]:
            opt.exclude_from_weight_decay(var_names=case["exclude"])
    names = list(variables)
    for step, (grads, want) in enumerate(zip(run["grads"], run["trajectory"])):
        if strategy is None:
            (g,) = grads
            opt.apply_gradients([(dec(g[k]), variables[k]) for k in names])
        else:

            def fn(grads=grads):
                r = cudist.get_replica_context().replica_id_in_sync_group
                opt.apply_gradients([(dec(grads[r][k]), variables[k]) for k in names])

            strategy.run(fn)
        assert int(opt.iterations) == want["iterations"]
        for k in names:
            got = np.asarray(variables[k].numpy())
            assert got.dtype == np.dtype(dtype)
            np.testing.assert_allclose(
                got, dec(want["variables"][k]), **TOL[dtype], err_msg=f"{case['name']} {kind} step {step} {k}"
            )
            if isinstance(variables[k], cudist.MirroredVariable):  # the mirrors stay bitwise equal
                for comp in variables[k].values[1:]:
                    value = comp.numpy()
                    value = value.get() if hasattr(value, "get") else np.asarray(value)  # a CuPy array
                    assert value.tobytes() == got.tobytes()
    if "finalized" in run:
        with scope:
            opt.finalize_variable_values(list(variables.values()))
        for k in names:
            np.testing.assert_allclose(np.asarray(variables[k].numpy()), dec(run["finalized"][k]), **TOL[dtype],
                                       err_msg=f"{case['name']} {kind} finalized {k}")


@pytest.mark.parametrize("kind, recorded", KINDS, ids=[k for k, _ in KINDS])
@pytest.mark.parametrize("name", sorted(CASES))
def test_trajectory_follows_keras(name, kind, recorded):
    case = CASES[name]
    _replay(case, kind, case["runs"][recorded])


@pytest.mark.gpu
@pytest.mark.parametrize("kind, recorded", GPU_KINDS, ids=[k for k, _ in GPU_KINDS])
@pytest.mark.parametrize("name", sorted(CASES))
def test_trajectory_follows_keras_on_gpus(name, kind, recorded):
    case = CASES[name]
    _replay(case, kind, case["runs"][recorded])


def test_clipping_is_per_replica_as_in_keras():
    """The recorded clipnorm runs differ between one device and 2 replicas (Keras 3 clips each
    replica's gradient before the all-reduce), and cudist follows both."""
    case = CASES["sgd_nesterov_clipnorm"]
    one = dec(case["runs"]["one"]["trajectory"][-1]["variables"]["kernel"])
    two = dec(case["runs"]["mirrored2"]["trajectory"][-1]["variables"]["kernel"])
    assert np.max(np.abs(one - two)) > 1e-3


# ------------------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("name", sorted(CASES))
def test_get_config_round_trips(name):
    case = CASES[name]
    opt = getattr(optimizers, case["optimizer"])(**cudist_kwargs(case["kwargs"]))
    config = opt.get_config()
    for key in ("name", "learning_rate", "weight_decay", "clipnorm", "global_clipnorm", "clipvalue", "use_ema",
                "ema_momentum", "ema_overwrite_frequency", "loss_scale_factor", "gradient_accumulation_steps"):
        assert key in config
    json.dumps(config)  # a schedule is serialized
    again = type(opt).from_config(config)
    assert again.get_config() == config
    for k, v in case["kwargs"].items():
        if k != "learning_rate":
            assert config[k] == v, k


def test_keras_argument_errors():
    with pytest.raises(ValueError, match="Only one of `clipnorm`, `clipvalue` and `global_clipnorm`"):
        optimizers.SGD(clipnorm=1.0, clipvalue=1.0)
    with pytest.raises(ValueError, match="`gradient_accumulation_steps` must be an integer >= 2"):
        optimizers.Adam(gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match="`ema_momentum` must be in the range"):
        optimizers.Adam(use_ema=True, ema_momentum=1.5)
    with pytest.raises(ValueError, match="`weight_decay` must be a float"):
        optimizers.AdamW(weight_decay=None)
    with pytest.raises(ValueError, match="`beta_1` must be in range"):
        optimizers.Lion(beta_1=0.0)


def test_scale_loss_and_slots_named_as_keras():
    assert optimizers.SGD(loss_scale_factor=8.0).scale_loss(2.0) == 16.0
    assert optimizers.SGD().scale_loss(2.0) == 2.0
    var = cudist.Variable(np.zeros(3, np.float32), name="w")
    expected = {
        optimizers.RMSprop(momentum=0.9, centered=True): ["velocity", "momentum", "average_gradient"],
        optimizers.Adagrad(): ["accumulator"],
        optimizers.Adamax(): ["momentum", "norm"],
        optimizers.Nadam(): ["momentum", "velocity"],
        optimizers.Lion(): ["momentum"],
        optimizers.AdamW(): ["momentum", "velocity"],
        optimizers.Adam(amsgrad=True): ["momentum", "velocity", "velocity_hat"],
        optimizers.SGD(use_ema=True): [],
    }
    for opt, slots in expected.items():
        opt.build([var])
        assert opt.built
        for s in slots:
            assert opt.get_slot(var, s).shape == (3,)
        # iteration, learning_rate, the slots, the moving average, Nadam's u_product
        assert len(opt.variables) == 2 + len(slots) + (1 if opt.use_ema else 0) + isinstance(opt, optimizers.Nadam)
    np.testing.assert_array_equal(optimizers.Adagrad(initial_accumulator_value=0.3).__class__(
        initial_accumulator_value=0.3).get_config()["initial_accumulator_value"], 0.3)
    opt = optimizers.Adagrad(initial_accumulator_value=0.3)
    opt.build([var])
    np.testing.assert_array_equal(opt.get_slot(var, "accumulator").numpy(), np.full(3, 0.3, np.float32))


@pytest.mark.parametrize("kind", ["one_device", "mirrored2", "central2"])
@pytest.mark.parametrize(
    "opt_cls, kwargs",
    [
        (optimizers.RMSprop, {"learning_rate": 0.01, "momentum": 0.9, "centered": True}),
        (optimizers.Nadam, {"learning_rate": 0.01, "weight_decay": 0.1}),
        (optimizers.Adam, {"learning_rate": 0.01, "use_ema": True}),
        (optimizers.Lion, {"learning_rate": 0.01}),
    ],
    ids=["rmsprop", "nadam", "adam_ema", "lion"],
)
def test_new_optimizers_checkpoint_and_continue_bit_identically(tmp_path, kind, opt_cls, kwargs):
    """cudist.train.Checkpoint saves the slots (and EMA averages) and iterations of the new
    optimizers; a fresh optimizer restored from it continues exactly (Nadam's momentum product
    follows from the restored iterations)."""
    from cudist import train

    def model(strategy):
        with strategy.scope():
            w = cudist.Variable(np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3), name="w")
            opt = opt_cls(**kwargs)
        return w, opt

    def steps(strategy, w, opt, rng_seed, n):
        rng = np.random.default_rng(rng_seed)
        for _ in range(n):
            g = rng.standard_normal((4, 3)).astype(np.float32)

            def fn(g=g):
                r = cudist.get_replica_context().replica_id_in_sync_group
                opt.apply_gradients([(g * np.float32(r + 1), w)])

            strategy.run(fn)

    s1 = make_strategy(kind)
    w, opt = model(s1)
    steps(s1, w, opt, 1, 3)
    path = train.Checkpoint(w=w, optimizer=opt).save(str(tmp_path / "ckpt"))
    steps(s1, w, opt, 2, 3)
    want = w.numpy()
    s2 = make_strategy(kind)
    w2, opt2 = model(s2)
    train.Checkpoint(w=w2, optimizer=opt2).restore(path).assert_consumed()
    assert int(opt2.iterations) == 3
    steps(s2, w2, opt2, 2, 3)
    assert w2.numpy().tobytes() == want.tobytes()


# ------------------------------------------------------------------------------ optimizer.variables (issue #31)
VARIABLES = json.loads((Path(__file__).parent / "data" / "keras_optimizer_variables.json").read_text())


def _keras_short_name(entry):
    """A Keras variable's name without its optimizer's scope; Nadam's unnamed product variable (Keras
    calls it "variable", "variable_1", ...: it is made without a name) is cudist's ``u_product``."""
    short = entry["path"].rsplit("/", 1)[-1]
    return "u_product" if entry["path"].startswith("variable") else short


@pytest.mark.parametrize("rec", VARIABLES["cases"], ids=lambda r: f"{r['optimizer']}-{r['dtype']}-{sorted(r['kwargs'])}")
def test_optimizer_variables_follow_keras(rec):
    """Names, order, shapes, dtypes of ``optimizer.variables`` once built and after a step (and the
    scalars' values: iteration, learning_rate, Nadam's u_product), as Keras 3.15 lists them."""
    rng = np.random.default_rng(31)
    dtype = rec["dtype"]
    kernel = cudist.Variable(np.zeros((4, 3), dtype), name="kernel")
    bias = cudist.Variable(np.zeros(3, dtype), name="bias")
    opt = getattr(optimizers, rec["optimizer"])(**cudist_kwargs(rec["kwargs"]))

    def described():
        return [{"name": v.name.split(":")[0].split("/", 1)[1], "shape": list(v.shape), "dtype": v.dtype.name, "value": v.numpy().tolist() if v.numpy().size <= 1 else None}
                for v in opt.variables]

    def keras(entries):  # less the gradient accumulators: cudist keeps them per replica (porting guide)
        return [{"name": _keras_short_name(e), "shape": e["shape"], "dtype": e["dtype"], "value": e["value"]}
                for e in entries if not e["path"].endswith("_gradient_accumulator")]

    for v in opt.variables:
        assert v.name.startswith(f"{opt.name}/") and v.name.endswith(":0"), v.name
    opt.build([kernel, bias])
    assert described() == keras(rec["built"])
    grads = [rng.standard_normal(v.shape).astype(dtype) for v in (kernel, bias)]
    opt.apply_gradients(zip(grads, [kernel, bias]))
    got, want = described(), keras(rec["after_step"])
    for g, w in zip(got, want):  # the scalars' values to float32 rounding (Nadam's product is a float64 here)
        if g["value"] is not None and w["value"] is not None:
            np.testing.assert_allclose(g.pop("value"), w.pop("value"), rtol=1e-6, err_msg=g["name"])
    assert got == want


def test_learning_rate_variable_follows_the_setter_and_checkpoints(tmp_path):
    """Keras 3: ``optimizer.learning_rate = x`` assigns the learning-rate variable; a schedule or a
    callable set later drops it; a checkpoint restores the rate (and so the variable)."""
    from cudist import train

    opt = optimizers.Adam(0.01, name="adam")
    lr_var = opt.variables[1]
    assert lr_var.name == "adam/learning_rate:0" and lr_var.dtype == np.float32 and not lr_var.trainable
    opt.learning_rate = 0.25
    assert lr_var.numpy() == np.float32(0.25) and opt.learning_rate == 0.25
    ckpt = train.Checkpoint(optimizer=opt)
    path = ckpt.save(str(tmp_path / "ckpt"))
    other = optimizers.Adam(0.5)
    train.Checkpoint(optimizer=other).restore(path).assert_existing_objects_matched()
    assert other.variables[1].numpy() == np.float32(0.25) and other.learning_rate == 0.25
    opt.learning_rate = lambda: 0.125
    assert [v.name for v in opt.variables] == ["adam/iteration:0"] and opt.learning_rate == 0.125
    sched = optimizers.SGD(schedules.ExponentialDecay(0.1, 3, 0.5), name="SGD")
    assert [v.name for v in sched.variables] == ["SGD/iteration:0"]
    with cudist.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():  # made under a strategy: mirrored, as iterations
        mirrored = optimizers.SGD(0.1)
    assert isinstance(mirrored.variables[1], cudist.MirroredVariable)
    mirrored.learning_rate = 0.5
    assert [c.numpy() for c in mirrored.variables[1].values] == [np.float32(0.5)] * 2


def test_default_names_follow_keras():
    """Keras 3.15's default names: the class in snake case, numbered from the second in a process
    (a fresh process here, as the recording's)."""
    import subprocess
    import sys

    code = ("import json; from cudist import optimizers as o; "
            f"print(json.dumps({{c: [getattr(o, c)().name for _ in range(2)] for c in {sorted(VARIABLES['default_names'])!r}}}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(p.stdout) == VARIABLES["default_names"]
    assert optimizers.Adam(name="mine").name == "mine" and optimizers.Adam(name="mine").name == "mine"  # as given


def test_an_optimizer_made_inside_run_has_one_name_over_the_replicas():
    """Each replica makes its own (as a user's step might): one default name for all, so that its
    variables are created once (different names would be "mismatching names" across replicas)."""
    s = make_strategy("mirrored2")
    with s.scope():
        v = cudist.Variable(np.zeros(3, np.float32), name="v")

    def step():
        opt = optimizers.Adam(0.1)
        opt.apply_gradients([(np.ones(3, np.float32), v)])
        return opt.name

    names = s.experimental_local_results(s.run(step))
    assert len(set(names)) == 1 and names[0].startswith("adam")
    assert optimizers.Adam().name == names[0]  # the number was not used up inside run
