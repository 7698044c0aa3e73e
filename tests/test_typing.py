"""The public API as type checkers and IDEs see it.

One ``mypy --strict`` run (shared by the tests below) checks a user's training script written
against the public API, with ``reveal_type`` lines, together with the modules that are annotated
(:data:`ANNOTATED_MODULES`, reported in full). The tests then read its output:

* :data:`CHECKS`: what mypy must reveal, exactly -- concrete classes, never ``Any`` (except numpy's
  own type parameters, and where a check says ``any_ok``: an API documented to return arbitrary
  values, e.g. ``strategy.run``'s nest, or a possibly-CuPy array, CuPy having no type information);
* :data:`PENDING_CHECKS`: method returns of the modules that are not annotated yet. Each is
  expected to fail *on Any* (an xfail that raises :class:`RevealedAny`); once its module is
  annotated it passes, the strict xfail turns that into a failure, and the check moves to CHECKS
  (with the exact type). Failing for another reason (a concrete but different type) fails at once;
* no error anywhere, except on script lines marked ``# untyped: <module>`` (calls into modules
  not annotated yet, which ``--strict`` reports); a marked line without errors fails too, so the
  markers go away as the modules get annotated.

Also here: the ``cudist._core`` stub against the extension and its bindings source, and
``cudist/__init__.py``'s lazy exports against what type checkers see.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import site
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import pytest

import cudist

pytest.importorskip("mypy", reason="mypy is in the test extra: pip install '.[test]'")

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(cudist.__file__).resolve().parent

#: Modules annotated for ``mypy --strict``: checked (and any error reported) in the run. Add a
#: module here once it is annotated; the others are followed silently.
ANNOTATED_MODULES = [
    "cudist",
    "cudist.__main__",
    "cudist._arrays",
    "cudist._blas",
    "cudist._central_storage_strategy",
    "cudist._dataplane",
    "cudist._dataplane.packing",
    "cudist._dataplane.placement",
    "cudist._dataplane.pool",
    "cudist._dataplane.reduce",
    "cudist._dataplane.transports",
    "cudist._dataplane.transports.mpi",
    "cudist._dataplane.transports.nccl",
    "cudist._dataplane.transports.shm",
    "cudist._context",
    "cudist._core",  # the stub, src/cudist/_core.pyi
    "cudist._dataplane.storage",
    "cudist._dataplane.update",
    "cudist._cross_device_ops",
    "cudist._devices",
    "cudist._distribute_lib",
    "cudist._input_lib",
    "cudist._mirrored_strategy",
    "cudist._one_device_strategy",
    "cudist._reduce_util",
    "cudist._schedules",
    "cudist._settings",
    "cudist._replica_engine",
    "cudist._tf1_iterators",
    "cudist._values",
    "cudist._variables",
    "cudist.config",
    "cudist.data",
    "cudist.errors",
    "cudist.experimental",
    "cudist.optimizers",
]

#: A user's script. ``# untyped: <module>`` marks a line whose errors come from that module not
#: being annotated yet; remove the marker when it is (the test then insists the line is clean).
SCRIPT = '''
from __future__ import annotations

import numpy as np
import numpy.typing as npt

import cudist
from cudist import _core, optimizers

cpu = cudist.config.list_physical_devices("CPU")[0]
cudist.config.set_logical_device_configuration(cpu, [cudist.config.LogicalDeviceConfiguration()] * 2)
logical = cudist.config.list_logical_devices("CPU")

strategy = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    w = cudist.Variable(np.zeros(3, np.float32), name="w")
    b = cudist.Variable(0.0, trainable=True, dtype=np.float32, aggregation=cudist.VariableAggregation.MEAN)
    opt = optimizers.SGD(0.1)
    adam = optimizers.Adam(learning_rate=optimizers.schedules.InverseTimeDecay(0.01, 1, 1.0), beta_1=0.8)

ds = (
    cudist.data.Dataset.from_tensor_slices(np.arange(24, dtype=np.float32).reshape(8, 3))
    .shuffle(8, seed=1)
    .map(lambda x: x * 2)
    .batch(4, drop_remainder=True)
    .prefetch(cudist.data.AUTOTUNE)
)
dist = strategy.experimental_distribute_dataset(ds, cudist.InputOptions(experimental_fetch_to_device=False))
dist_iter = iter(dist)


def step(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    ctx = cudist.get_replica_context()
    assert ctx is not None  # None only in cross-replica context (inside scope(), outside run)
    total = ctx.all_reduce(cudist.ReduceOp.SUM, x)
    w.assign_sub(0.01 * total)
    b.assign_add(float(total.sum()))
    opt.apply_gradients([(total, w)])
    return x


for batch in dist:
    out = strategy.run(step, args=(batch,))
    loss = strategy.reduce("sum", out, axis=None)
    parts = strategy.experimental_local_results(out)
print(w.numpy(), float(b), w * 2 + 1)

a = np.ones(4, np.float32)
_core.all_reduce([a, a.copy()], _core.SUM)
rctx = cudist.get_replica_context()  # outside any scope: the default replica context
assert rctx is not None
'''


class Check(NamedTuple):
    """``reveal_type(expr)`` at the end of :data:`SCRIPT` must show ``expected``.

    ``returns``: compare only the return type of a callable (a class: what calling it makes), so
    that the class itself is checked while its constructor's parameters are not annotated yet.
    ``expected`` None (pending checks only): any type without ``Any``.
    ``any_ok``: the API returns arbitrary values by design, documented as such in its docstring
    (a nest the caller's function returns, a GPU array, CuPy having no type information): ``Any``
    in the type is expected; the type must still be exactly ``expected``.
    """

    expr: str
    expected: str | None
    returns: bool = False
    any_ok: bool = False


# An array of a dtype known only at run time; the script's ``a`` (np.ones(4, np.float32)).
_ARRAY = "numpy.ndarray[tuple[Any, ...], numpy.dtype[Any]]"
_A = "numpy.ndarray[tuple[int], numpy.dtype[numpy.floating[numpy._typing._nbit_base._32Bit]]]"

#: Strict now: each must be revealed exactly (the public names resolve to their real classes).
CHECKS = [
    # the classes behind the lazy exports, and instances of them
    Check(
        "cudist.MirroredStrategy",
        "def (devices: typing.Sequence[str | cudist._devices._Named] | None =, "
        "cross_device_ops: cudist._cross_device_ops.CrossDeviceOps | None =) -> cudist._mirrored_strategy.MirroredStrategy",
    ),
    Check("strategy", "cudist._mirrored_strategy.MirroredStrategy"),
    Check(
        "cudist.OneDeviceStrategy",
        "def (device: str | cudist._devices._Named) -> cudist._one_device_strategy.OneDeviceStrategy",
    ),
    Check("cudist.CentralStorageStrategy", "cudist._central_storage_strategy.CentralStorageStrategy", returns=True),
    Check(
        "cudist.experimental.CentralStorageStrategy",
        "cudist._central_storage_strategy.CentralStorageStrategy",
        returns=True,
    ),
    Check("cudist.Variable", "cudist._variables.Variable", returns=True),
    Check("w", "cudist._variables.Variable"),
    Check("cudist.data.Dataset", "cudist.data.Dataset", returns=True),
    Check("cudist.PerReplica", "cudist._values.PerReplica", returns=True),
    Check("cudist.Mirrored", "cudist._values.Mirrored", returns=True),
    Check("opt", "cudist.optimizers.SGD"),
    Check("optimizers.Adam", "cudist.optimizers.Adam", returns=True),
    Check("cudist.ReduceOp.SUM", "Literal[cudist._reduce_util.ReduceOp.SUM]?"),
    Check("cudist.__version__", "str"),
    Check("cudist.get_include()", "str"),
    # constructors
    Check("optimizers.SGD(0.1, momentum=0.9, nesterov=True, name='sgd')", "cudist.optimizers.SGD"),
    Check("cudist.NcclAllReduce(num_packs=2)", "cudist._cross_device_ops.NcclAllReduce"),
    # Strategy and its extended part
    Check("strategy.num_replicas_in_sync", "int"),
    Check("strategy.extended", "cudist._distribute_lib.StrategyExtended"),
    Check("strategy.scope()", "contextlib.AbstractContextManager[cudist._distribute_lib.Strategy, Literal[False]]"),
    Check("strategy.extended.worker_devices", "tuple[str, ...]"),
    Check("cudist.MirroredStrategy().extended.worker_devices", "tuple[str, ...]"),
    Check("cudist.CentralStorageStrategy(['/cpu:0', '/cpu:1']).extended.parameter_devices", "tuple[str, ...]"),
    Check("strategy.run(step, args=(a,))", "Any", any_ok=True),  # the replica function's nest, PerReplica leaves
    Check("strategy.reduce('sum', out, axis=None)", f"{_ARRAY} | Any", any_ok=True),  # a nest for a nest
    Check("strategy.gather(out, axis=0)", f"{_ARRAY} | Any", any_ok=True),
    Check("strategy.experimental_local_results(out)", "tuple[Any, ...]", any_ok=True),
    Check("strategy.extended.reduce_to('mean', out, '/cpu:0')", f"{_ARRAY} | Any | cudist._values.Mirrored", any_ok=True),
    Check("cudist.get_strategy()", "cudist._distribute_lib.Strategy"),
    Check("cudist.has_strategy()", "bool"),
    # replica context
    Check("cudist.get_replica_context()", "cudist._distribute_lib.ReplicaContext | None"),
    Check("rctx.all_reduce(cudist.ReduceOp.SUM, a)", _A),  # the value's type
    Check("rctx.all_gather(a, axis=0)", _A),
    Check("rctx.replica_id_in_sync_group", "int"),
    # distributed input
    Check("strategy.experimental_distribute_dataset(ds)", "cudist._input_lib.DistributedDataset"),
    Check("dist_iter", "cudist._input_lib.DistributedIterator"),
    Check("next(dist_iter)", "Any", any_ok=True),  # a step: the dataset's element, PerReplica leaves
    Check("dist_iter.get_next_as_optional().has_value()", "bool"),
    Check("dist.reduce(0, lambda n, s: n + 1)", "int"),
    Check(
        "strategy.distribute_datasets_from_function(lambda c: ds.shard(c.num_input_pipelines, c.input_pipeline_id))",
        "cudist._input_lib.DistributedDatasetsFromFunction",
    ),
    Check("cudist.InputOptions().experimental_per_replica_buffer_size", "int"),
    # variables and optimizers
    Check("w.name", "str"),
    Check("w.device", "str"),
    Check("w.dtype", "numpy.dtype[Any]"),
    Check("w.shape", "tuple[int | None, ...]"),
    Check("w.numpy()", f"{_ARRAY} | numpy.number[Any, int | float | complex] | numpy.bool[bool]"),
    Check("w.read_value()", f"{_ARRAY} | Any", any_ok=True),  # NumPy, or CuPy on a GPU
    Check("w * 2", f"{_ARRAY} | Any", any_ok=True),
    Check(
        "w.assign_add(1.0)",  # the variable; a distributed one's updated value; None with read_value=False
        f"cudist._variables.Variable | cudist._values.Mirrored | {_ARRAY} | Any | None",
        any_ok=True,
    ),
    Check("opt.apply_gradients([(a, w)])", "cudist._variables.Variable"),
    Check("adam.apply_gradients(zip([a], [w]))", "cudist._variables.Variable"),
    Check("opt.iterations", "cudist._variables.Variable"),
    Check("opt.get_slot(w, 'momentum')", "cudist._variables.Variable"),
    # cudist.data
    Check("ds", "cudist.data.Dataset"),
    Check("cudist.data.Dataset.range(10).repeat(2).take(5).skip(1).shard(2, 0)", "cudist.data.Dataset"),
    Check("cudist.data.Dataset.zip(ds, ds).enumerate().unbatch().filter(lambda i, e: i > 0)", "cudist.data.Dataset"),
    Check("ds.cardinality()", "int"),
    Check("ds.reduce(0, lambda n, e: n + 1)", "int"),
    Check("cudist.data.as_dataset([a, a])", "cudist.data.Dataset"),
    Check("cudist.data.TensorSpec((None, 3), np.float32).is_compatible_with(a)", "bool"),
    # ReduceOp, config, values, _core
    Check("cudist.ReduceOp.parse('sum')", "cudist._reduce_util.ReduceOp"),
    Check("logical[0].name", "str"),
    Check("cudist.config.list_physical_devices()[0].device_type", "str"),
    Check("_core.num_threads()", "int"),
    Check("_core.cuda_built", "bool"),
    Check("_core.set_streaming_threshold(1 << 20)", "int"),
]

#: Method returns of modules that are not annotated yet. Each reveals Any today; extend the list
#: when the script starts calling into such a module, and move a check to CHECKS (with its exact
#: type) once it passes. Empty: every module the script calls into is annotated.
PENDING_CHECKS: list[Check] = []


class RevealedAny(AssertionError):
    """A check failed because mypy revealed ``Any`` (what a pending check expects)."""


# numpy's arrays carry their shape as tuple[Any, ...]: that Any is numpy's, not a missing annotation.
_NUMPY_SHAPE = "numpy.ndarray[tuple[Any, ...], "
# So are the dtype of an array whose dtype is known only at run time (a Variable's: dtype[Any]) and
# the precision of such a NumPy scalar (number[Any, ...]).
_NUMPY_ANY = re.compile(r"numpy\.ndarray\[tuple\[Any, \.\.\.\], |numpy\.dtype\[Any\]|numpy\.number\[Any, ")


def _has_any(revealed: str) -> bool:
    return re.search(r"\bAny\b", _NUMPY_ANY.sub("<numpy>", revealed)) is not None


def _returns(revealed: str) -> str:
    """The return type of a revealed callable ``def (...) -> T``."""
    return revealed.rsplit(" -> ", 1)[1] if revealed.startswith("def ") else revealed


def _normalize(revealed: str) -> str:
    # Older mypy versions spell out builtins.; numpy 1.x arrays have the shape type Any, NumPy 2.2
    # (the last for Python 3.10) tuple[int, ...]; NumPy 2.5 defaults a scalar's item type to Any
    # where 2.2-2.4 default it to int | float | complex (the annotation says np.number[Any] in all).
    return (
        revealed.replace("builtins.", "")
        .replace("numpy.ndarray[Any, ", _NUMPY_SHAPE)
        .replace("numpy.ndarray[tuple[int, ...], ", _NUMPY_SHAPE)
        .replace("numpy.number[Any, Any]", "numpy.number[Any, int | float | complex]")
    )


class MypyRun(NamedTuple):
    script_lines: list[str]
    revealed: dict[int, str]  # script line number -> revealed type
    errors: list[tuple[str, int, str]]  # (file, line, message)
    reveal_lines: dict[str, int]  # check key -> script line
    pending_lines: set[int]  # the reveal_type lines of PENDING_CHECKS
    output: str


def _check_key(group: str, check: Check) -> str:
    return f"{group}:{check.expr}"


def _mypy_search_path() -> str | None:
    """Where mypy finds the imported cudist, when that is not an installed copy.

    An installed cudist (``pip install .``) sits in site-packages, which mypy searches by itself.
    An editable install points Python at the source tree through an import hook, which mypy
    cannot follow; it is then given the source tree.
    """
    parent = PACKAGE.parent
    site_dirs = {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}
    return None if parent in site_dirs else str(parent)


def _run_mypy(tmp: Path) -> MypyRun:
    script = textwrap.dedent(SCRIPT).lstrip("\n")
    lines = script.splitlines()
    reveal_lines: dict[str, int] = {}
    for group, checks in (("check", CHECKS), ("pending", PENDING_CHECKS)):
        for check in checks:
            lines.append(f"reveal_type({check.expr})")
            reveal_lines[_check_key(group, check)] = len(lines)
    (tmp / "user_script.py").write_text("\n".join(lines) + "\n")
    env = dict(os.environ)
    path = _mypy_search_path()
    if path:
        env["MYPYPATH"] = path
    else:
        env.pop("MYPYPATH", None)
    cmd = [
        sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-error-summary",
        "--show-absolute-path", "--hide-error-context", "--no-color-output", "--no-pretty",
        "--cache-dir", str(tmp / "mypy_cache"), "-m", "user_script",
    ]
    for module in ANNOTATED_MODULES:
        cmd += ["-m", module]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode not in (0, 1) or proc.stderr.strip():
        pytest.fail(f"mypy did not run (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    script_file = str((tmp / "user_script.py").resolve())
    revealed: dict[int, str] = {}
    errors: list[tuple[str, int, str]] = []
    for row in proc.stdout.splitlines():
        m = re.match(r"^(.*?):(\d+): (error|note): (.*)$", row)
        if not m:
            continue
        file, line, kind, message = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        note = re.match(r'^Revealed type is "(.*)"$', message)
        if kind == "note" and note and file == script_file:
            revealed[line] = _normalize(note.group(1))
        elif kind == "error":
            errors.append((file, line, message))
    pending = {line for key, line in reveal_lines.items() if key.startswith("pending:")}
    return MypyRun(lines, revealed, errors, reveal_lines, pending, proc.stdout)


@pytest.fixture(scope="module")
def mypy_run(tmp_path_factory: pytest.TempPathFactory) -> MypyRun:
    return _run_mypy(tmp_path_factory.mktemp("typing"))


def _verify(run: MypyRun, group: str, check: Check) -> None:
    line = run.reveal_lines[_check_key(group, check)]
    got = run.revealed.get(line)
    assert got is not None, f"mypy revealed nothing for {check.expr!r} (line {line}):\n{run.output}"
    if check.returns:
        got = _returns(got)
    if _has_any(got) and not check.any_ok:
        raise RevealedAny(f"reveal_type({check.expr}) is {got!r}: it contains Any")
    if check.expected is not None:
        assert got == check.expected, f"reveal_type({check.expr}) is {got!r}, expected {check.expected!r}"


@pytest.mark.parametrize("check", CHECKS, ids=[c.expr for c in CHECKS])
def test_revealed_type(mypy_run: MypyRun, check: Check) -> None:
    _verify(mypy_run, "check", check)


@pytest.mark.parametrize(
    "check",
    [pytest.param(c, marks=pytest.mark.xfail(raises=RevealedAny, strict=True, reason="module not annotated yet"))
     for c in PENDING_CHECKS],
    ids=[c.expr for c in PENDING_CHECKS],
)
def test_revealed_type_pending(mypy_run: MypyRun, check: Check) -> None:
    _verify(mypy_run, "pending", check)


def test_no_errors_outside_untyped_lines(mypy_run: MypyRun) -> None:
    untyped = {i for i, text in enumerate(mypy_run.script_lines, 1) if re.search(r"#\s*untyped:", text)}
    tolerated = untyped | mypy_run.pending_lines  # a pending reveal_type(...) may call untyped code too
    unexpected = [
        f"{file}:{line}: {message}"
        for file, line, message in mypy_run.errors
        if not (file.endswith("user_script.py") and line in tolerated)
    ]
    assert not unexpected, "mypy --strict reports errors:\n" + "\n".join(unexpected)
    errored = {line for file, line, _ in mypy_run.errors if file.endswith("user_script.py")}
    clean = sorted(untyped - errored)
    assert not clean, "these lines are marked '# untyped' but type-check cleanly; remove the markers:\n" + "\n".join(
        f"{i}: {mypy_run.script_lines[i - 1].strip()}" for i in clean
    )


# ------------------------------------------------------------------------------ cudist/__init__.py


def _type_checking_imports() -> dict[str, str]:
    """Name -> module of the imports under ``if TYPE_CHECKING:`` in cudist/__init__.py."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom) and stmt.module:
                    for alias in stmt.names:
                        out[alias.asname or alias.name] = stmt.module
    return out


def test_type_checkers_see_every_lazy_export() -> None:
    seen = _type_checking_imports()
    expected = {name: f"cudist.{mod}" for name, mod in cudist._EXPORTS.items()}
    expected.update({name: "cudist" for name in cudist._SUBMODULES})
    assert seen == expected


def test_all_is_complete_and_resolves() -> None:
    assert len(cudist.__all__) == len(set(cudist.__all__))
    assert set(cudist.__all__) == {*cudist._EXPORTS, *cudist._SUBMODULES, "get_include", "get_cmake_dir", "__version__"}
    for name in cudist.__all__:
        assert getattr(cudist, name) is not None, name
    assert cudist.MirroredStrategy is importlib.import_module("cudist._mirrored_strategy").MirroredStrategy


# ------------------------------------------------------------------------------ the _core stub

STUB = PACKAGE / "_core.pyi"
BINDINGS = ROOT / "csrc" / "bindings" / "core.cpp"


def _stub_names() -> tuple[dict[str, ast.FunctionDef], set[str]]:
    """The stub's public functions (name -> def) and public attributes."""
    tree = ast.parse(STUB.read_text())
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    attributes = {
        n.target.id
        for n in tree.body
        if isinstance(n, ast.AnnAssign)
        and isinstance(n.target, ast.Name)
        and (not n.target.id.startswith("_") or n.target.id == "__version__")
    }
    return functions, attributes


RULES_HEADER = ROOT / "csrc" / "include" / "cudist" / "detail" / "update_rules.hpp"


def _rules_table() -> dict[str, tuple[list[str], list[str]]]:
    """CUDIST_UPDATE_RULE_LIST: name -> (slot names, hyper-parameter names before ``decay``)."""
    from cudist._kernels._cuda_launch import parse_update_rules

    rows = parse_update_rules(RULES_HEADER.read_text())
    return {name: (list(slots), list(hyper)) for name, (_, slots, hyper) in rows.items()}


def _rule_functions() -> set[str]:
    """The extension's functions bound from the rules' table (the stub declares them by ``__getattr__``)."""
    return {f for name in _rules_table() for f in (name, f"all_reduce_{name}")}


def _bindings_source() -> tuple[set[str], set[str], set[str]]:
    """From core.cpp: (functions defined, attributes set, functions defined only with CUDA)."""
    text = BINDINGS.read_text()
    body = text[text.index("PYBIND11_MODULE(") :]
    defined = re.compile(r'\bm\.def\(\s*"(\w+)"')
    functions = set(defined.findall(body))
    for other in sorted(BINDINGS.parent.glob("*.cpp")):  # blocks bound from their own files (fdio.cpp)
        if other != BINDINGS:
            functions |= set(defined.findall(other.read_text()))
    if "CUDIST_UPDATE_RULES(" in body:  # the optimizers' bindings, generated from the rules' table
        functions |= _rule_functions()
    attributes = set(re.findall(r'\bm\.attr\(\s*"(\w+)"\)', body))
    cuda_only: set[str] = set()
    m = re.search(r"#ifdef CUDIST_CORE_WITH_CUDA(.*?)#else(.*?)#endif", body, re.S)
    if m:
        cuda_only = set(defined.findall(m.group(1))) - set(defined.findall(m.group(2)))
    return functions, attributes, cuda_only


def _core_module() -> ModuleType:
    return pytest.importorskip("cudist._core", reason="the C++ extension is not built")


def test_core_stub_matches_the_extension() -> None:
    core = _core_module()
    functions, attributes = _stub_names()
    public = {n for n in dir(core) if not n.startswith("_")}
    callables = {n for n in public if callable(getattr(core, n))}
    # Functions that only a CUDA build defines may be missing from a CPU-only build.
    cuda_only = _bindings_source()[2] if BINDINGS.is_file() else {"cuda_all_reduce", "cuda_p2p_all_reduce"}
    optional = set() if core.cuda_built else cuda_only
    rules = _rule_functions()
    assert rules and rules <= callables, "the rules' table names functions cudist._core lacks"
    assert not rules & set(functions), "a rule of the table declared by name in _core.pyi (its __getattr__ covers them)"
    assert callables - set(functions) - rules == set(), "in cudist._core but not in _core.pyi"
    assert set(functions) - callables - optional == set(), "in _core.pyi but not in cudist._core"
    assert (public - callables) | {"__version__"} == attributes, "module attributes differ from the stub's"


def test_core_stub_matches_the_bindings_source() -> None:
    # Catches a binding added to core.cpp before any build has it (and CUDA-only ones on CPU).
    if not BINDINGS.is_file():
        pytest.skip("no source tree")
    functions, attributes, _ = _bindings_source()
    stub_functions, stub_attributes = _stub_names()
    assert functions - _rule_functions() == set(stub_functions), "core.cpp's m.def names differ from _core.pyi's functions"
    assert "def __getattr__(name: str) -> Callable[..., None]:" in STUB.read_text(), "the rules' generic entry"
    assert attributes == stub_attributes, "core.cpp's m.attr names differ from _core.pyi's attributes"


def _pybind_parameters(doc: str, name: str) -> list[tuple[str, bool]]:
    """(name, has a default) per parameter of pybind11's signature line ``name(a: T, b: U = x) -> R``."""
    first = doc.splitlines()[0]
    assert first.startswith(name + "("), first
    inner = first[len(name) + 1 : first.rindex(") -> ")]
    params, depth, current = [], 0, ""
    for ch in inner + ",":
        if ch == "," and depth == 0:
            if current.strip():
                params.append(current.strip())
            current = ""
            continue
        depth += ch in "([{"
        depth -= ch in ")]}"
        current += ch
    return [(p.split(":")[0].strip(), "=" in p) for p in params]


def test_core_stub_parameters_match_the_extension() -> None:
    core = _core_module()
    functions, _ = _stub_names()
    for name, fn in functions.items():
        if not hasattr(core, name):
            continue  # CUDA-only in a CPU build: covered by the source check above
        args = fn.args.posonlyargs + fn.args.args
        stub = [(a.arg, i >= len(args) - len(fn.args.defaults)) for i, a in enumerate(args)]
        assert stub == _pybind_parameters(getattr(core, name).__doc__, name), name


def test_rule_bindings_take_the_tables_parameters() -> None:
    """Each binding generated from CUDIST_UPDATE_RULES takes ``copies``, its slots' copies (``<slot>s``),
    the gradient(s), the table's hyper-parameters and ``decay``, in that order, none defaulted, then
    ``sources`` (defaulted: in place), and is listed in ``out_of_place_rules``; and the C++ table
    agrees with the Python one (cudist._kernels.update_variants(): its rows' variants)."""
    from cudist._kernels import update_variants

    core = _core_module()
    table = _rules_table()
    assert len(table) >= 6
    assert set(table) == set(update_variants())  # every variant of the Python table
    for name, (slots, hyper) in table.items():
        assert update_variants()[name][1:] == (tuple(slots), (*hyper, "decay")), name
        for fused in (False, True):
            fn = f"all_reduce_{name}" if fused else name
            want = ["copies", *(f"{s}s" for s in slots), "grads" if fused else "grad", *hyper, "decay"]
            got = _pybind_parameters(getattr(core, fn).__doc__, fn)
            assert got == [(p, False) for p in want] + [("sources", True)], fn
            assert fn in core.out_of_place_rules, fn
