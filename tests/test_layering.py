"""The package's structure, enforced: layers, no import cycles, no private names across modules
(imported names, ``module._x``, and attribute reads ``obj._x`` of a name the reading module does not
define), the optimizer above the kernels.

Walks the AST of every module under ``src/cudist`` (imports inside functions included, since a
lazy import is still a dependency). The layers, bottom to top, are documented in CONTRIBUTING.md's
architecture section; a module may import its own layer or lower ones only.
"""

from __future__ import annotations

import ast
import collections
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "cudist"

#: Bottom to top. A module's layer is that of the longest listed prefix of its name.
LAYERS = [
    # 0: no cudist imports above these: device names, ops, the context stack, values, arrays, errors
    ["cudist._core", "cudist._devices", "cudist._reduce_util", "cudist._context", "cudist._values",
     "cudist.errors", "cudist.config", "cudist._arrays", "cudist._collective_util", "cudist._blas",
     "cudist._settings", "cudist.mixed_precision"],
    # 1: the kernel contract and its backends
    ["cudist._kernels"],
    # 2: the data plane (variable storage, the fused update pass, reductions, pool, transports),
    #    datasets, the replica engine, the GPU input feeder
    ["cudist._dataplane", "cudist.data", "cudist._replica_engine", "cudist._gpu_feeder", "cudist.cluster_resolver"],
    # 3: cross-device ops, distributed input
    ["cudist._cross_device_ops", "cudist._input_lib", "cudist._tf1_iterators", "cudist._collective_ops"],
    # 4: Strategy, StrategyExtended, ReplicaContext
    ["cudist._distribute_lib"],
    # 5: variables (built by the strategies' _create_variable hooks)
    ["cudist._variables"],
    # 6: the strategies
    ["cudist._one_device_strategy", "cudist._mirrored_strategy", "cudist._central_storage_strategy",
     "cudist._collective_all_reduce_strategy", "cudist.experimental"],
    # 7: training (metrics build on losses)
    ["cudist._schedules", "cudist.optimizers", "cudist.nn", "cudist.losses", "cudist.metrics", "cudist.train"],
    # 8: the public package, its CLI and the benchmarks
    ["cudist", "cudist.__main__", "cudist.bench", "cudist.launch"],
]

#: Packages whose ``_``-prefixed submodules are private to the package.
PACKAGES = ("cudist._kernels", "cudist._dataplane", "cudist.bench", "cudist.train")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}
KNOWN = set(MODULES) | {"cudist._core"}


def layer_of(mod: str) -> int:
    best, layer = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (mod == name or mod.startswith(name + ".")) and len(name) > best:
                best, layer = len(name), i
    if layer is None:
        raise AssertionError(f"module {mod} is in no layer: add it to LAYERS (and CONTRIBUTING.md's layout)")
    return layer


def component(mod: str) -> str:
    """The unit privacy is judged by: a package of PACKAGES, else the module itself."""
    for pkg in PACKAGES:
        if mod == pkg or mod.startswith(pkg + "."):
            return pkg
    return mod


def _resolve(mod: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    pkg = mod if MODULES[mod].name == "__init__.py" else mod.rsplit(".", 1)[0]
    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def imports_of(mod: str):
    """(imported module, imported private name or None, line) for every cudist import of ``mod``."""
    tree = ast.parse(MODULES[mod].read_text())
    out = []
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _resolve(mod, node)
            if not base.startswith("cudist"):
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in KNOWN:
                    out.append((full, None, node.lineno))
                    aliases[a.asname or a.name] = full
                else:
                    out.append((base, a.name if a.name.startswith("_") else None, node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("cudist"):
                    out.append((a.name, None, node.lineno))
                    if a.asname:
                        aliases[a.asname] = a.name
    for node in ast.walk(tree):  # module._private attribute reads
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            out.append((aliases[node.value.id], node.attr, node.lineno))
    return out


def _graph():
    return {m: {t for t, _, _ in imports_of(m) if t != m and t in KNOWN} for m in MODULES}


def test_every_module_has_a_layer():
    for mod in MODULES:
        layer_of(mod)


def test_imports_go_down_the_layers():
    bad = []
    for mod in MODULES:
        lm = layer_of(mod)
        for target, _, line in imports_of(mod):
            if target in KNOWN and target != mod and layer_of(target) > lm and not mod.startswith(target + "."):
                bad.append(f"{MODULES[mod].name}:{line} ({mod}, layer {lm}) imports {target} (layer {layer_of(target)})")
    assert not bad, "imports up the layers:\n" + "\n".join(bad)


def test_kernels_import_nothing_above_them():
    allowed = {"cudist._core", "cudist._devices", "cudist._reduce_util", "cudist._arrays", "cudist.config", "cudist",
               "cudist._settings"}
    for mod in MODULES:
        if component(mod) != "cudist._kernels":
            continue
        for target, _, line in imports_of(mod):
            assert target.startswith("cudist._kernels") or target in allowed, f"{mod}:{line} imports {target}"


def test_no_import_cycles():
    graph = _graph()
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                cycles.append(sorted(scc))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_names_across_modules():
    bad = []
    for mod in MODULES:
        for target, name, line in imports_of(mod):
            if component(target) == component(mod):
                continue
            if name is not None and target != "cudist":  # cudist._core is a module, not a private name
                bad.append(f"{mod}:{line} uses {target}.{name}")
            # a package's underscored submodules are private to it
            for pkg in PACKAGES:
                rest = target[len(pkg) + 1 :] if target.startswith(pkg + ".") else ""
                if rest.startswith("_") and component(mod) != pkg:
                    bad.append(f"{mod}:{line} imports {target}, private to {pkg}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "source, mod, expect",
    [
        ("from cudist._distribute_lib import _CTX\n", "cudist._replica_engine", "uses cudist._distribute_lib._CTX"),
        ("from cudist import _input_lib\nx = _input_lib._identity\n", "cudist._tf1_iterators", "_input_lib._identity"),
        ("from cudist._kernels._numpy import NumpyBackend\n", "cudist.optimizers", "private to cudist._kernels"),
    ],
)
def test_the_checks_catch_violations(monkeypatch, tmp_path, source, mod, expect):
    """The walker itself: planted violations are reported (a check that cannot fail proves nothing)."""
    fake = tmp_path / "m.py"
    fake.write_text(source)
    monkeypatch.setitem(MODULES, mod, fake)
    with pytest.raises(AssertionError, match=expect.replace(".", r"\.")):
        test_no_private_names_across_modules()


def test_a_cycle_is_caught(monkeypatch, tmp_path):
    fake = tmp_path / "m.py"
    fake.write_text("from cudist import _replica_engine\n")
    monkeypatch.setitem(MODULES, "cudist._context", fake)
    monkeypatch.setitem(MODULES, "cudist._replica_engine", tmp_path / "e.py")
    (tmp_path / "e.py").write_text("from cudist._context import CTX\n")
    with pytest.raises(AssertionError, match="import cycles"):
        test_no_import_cycles()


def test_an_upward_import_is_caught(monkeypatch, tmp_path):
    fake = tmp_path / "m.py"
    fake.write_text("from cudist import optimizers\n")
    monkeypatch.setitem(MODULES, "cudist._kernels._planted", fake)
    with pytest.raises(AssertionError, match="imports up the layers"):
        test_imports_go_down_the_layers()


def test_the_optimizer_does_not_import_the_kernels():
    """Keras semantics in optimizers.py; the kernel work goes through cudist._dataplane.update."""
    bad = [f"optimizers.py:{line} imports {t}" for t, _, line in imports_of("cudist.optimizers") if t.startswith("cudist._kernels")]
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------- private attribute reads: obj._x
#: At most this many reads of another module's private attributes in the whole package, each marked
#: on its line with ``# private-read: why`` (issue #27).
PRIVATE_READ_BUDGET = 5
_MARK = re.compile(r"#\s*private-read:\s*\S")

def private_reads(path: Path) -> list[tuple[int, str, bool]]:
    """(line, attribute, marked) per read of ``obj._x`` in ``path`` where ``obj`` is not self/cls and
    ``_x`` (not a dunder) is defined nowhere in the module: no def/class of that name, no assignment
    to an attribute or variable of that name, no argument or import alias."""
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    defined = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            defined.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            defined.add(n.id)
        elif isinstance(n, ast.arg):
            defined.add(n.arg)
        elif isinstance(n, ast.alias):
            defined.add(n.asname or n.name.split(".")[0])
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                continue
            if n.attr in defined:
                continue
            # The mark may sit on any line of the expression (a call split over lines).
            span = lines[n.lineno - 1 : (n.end_lineno or n.lineno)]
            out.append((n.lineno, n.attr, any(_MARK.search(line) for line in span)))
    return sorted(out)


def _private_read_report(src: Path = SRC) -> tuple[list[str], collections.Counter[str], list[str]]:
    """(every counted read, reads per file, unmarked reads)."""
    counted, per_file, unmarked = [], collections.Counter(), []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        for line, attr, marked in private_reads(path):
            hit = f"{rel}:{line}: .{attr}"
            counted.append(hit)
            per_file[rel] += 1
            if not marked:
                unmarked.append(hit)
    return counted, per_file, unmarked


def test_private_attribute_reads_across_modules_are_few_and_explained():
    counted, per_file, unmarked = _private_read_report()
    summary = ", ".join(f"{f}: {n}" for f, n in per_file.most_common()) or "none"
    assert not unmarked, (
        "reads of another module's private attributes (obj._x) without a '# private-read: why' comment "
        f"on the line -- give the attribute a public name instead (per file: {summary}):\n" + "\n".join(unmarked)
    )
    assert len(counted) <= PRIVATE_READ_BUDGET, (
        f"{len(counted)} private attribute reads across modules, more than the budget of {PRIVATE_READ_BUDGET} "
        f"(per file: {summary}):\n" + "\n".join(counted)
    )


def test_the_private_read_scan_catches_reads(tmp_path):
    """The scan itself: a planted read is found, a marked one is marked, self/defined names are not reads."""
    (tmp_path / "m.py").write_text(
        "class A:\n"
        "    def f(self, other):\n"
        "        self._mine = other._theirs\n"
        "        return other._mine, other._marked  # private-read: planted for the test\n"
    )
    assert private_reads(tmp_path / "m.py") == [(3, "_theirs", False), (4, "_marked", True)]
    counted, per_file, unmarked = _private_read_report(tmp_path)
    assert per_file == {"m.py": 2} and unmarked == ["m.py:3: ._theirs"]
