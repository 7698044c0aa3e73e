"""What the CuPy backend launches, and through what; importable without CuPy (or a GPU).

* The kernel list is declared once, in ``<cudist/kernels/kernel_list.cuh>`` plus one fused kernel
  ``mirrored_all_reduce_<name>`` (floating-point dtypes) per row of the update rules' table
  (``CUDIST_UPDATE_RULE_LIST`` in ``<cudist/detail/update_rules.hpp>``): the C++ kernels and
  launchers of ``cudist::cuda`` are generated / instantiated from them, and :func:`kernel_list`
  parses both for the CuPy backend's NVRTC name expressions (``cudist::kernels::<kernel>_packed<T>``).
* The launch path: where ``cudist._core`` was built with CUDA and its runtime sees the GPUs (and
  its kernels were built for them, :func:`runs_on`), the CuPy backend runs its collectives through
  those launchers, on CuPy's current stream; NVRTC (``cupy.RawModule``) is the fallback and runs
  everything else. ``CUDIST_CUDA_LAUNCHERS``, read when the backend loads, chooses: ``auto``
  (default), ``core`` (the launchers or an error) or ``nvrtc`` (never the launchers).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from cudist import _settings

__all__ = [
    "KERNEL_LIST",
    "LAUNCHERS_ENV",
    "LAUNCH_MODES",
    "kernel_list",
    "dtype_ctypes",
    "launch_mode",
    "launch_policy",
    "parse_kernel_list",
    "parse_update_rules",
    "parse_mixed_gradients",
    "mixed_gradients",
    "FUSED_PREFIX",
    "takes_mixed_gradients",
    "runs_on",
]

#: The header declaring the kernel list, relative to :func:`cudist.get_include`.
KERNEL_LIST = "cudist/kernels/kernel_list.cuh"
#: The header of the update rules' table, relative to :func:`cudist.get_include`.
UPDATE_RULES = "cudist/detail/update_rules.hpp"
#: The dtype set of the kernels generated from that table.
RULE_KERNEL_DTYPES = "FLOAT"
#: The environment variable choosing the CuPy backend's launch path.
LAUNCHERS_ENV = "CUDIST_CUDA_LAUNCHERS"
#: Its values: the launchers where they can serve (default), always them, never them.
LAUNCH_MODES = ("auto", "core", "nvrtc")

# One `#define NAME(params) \` macro and its continuation lines.
_MACRO = r"#define\s+{name}\({params}\)((?:[^\n]*\\\n)*[^\n]*)"
_DTYPE_SET = re.compile(_MACRO.format(name=r"CUDIST_DTYPES_(\w+)", params=r"D, A"))
_DTYPE = re.compile(r"\bD\(A,\s*([\w ]+?),\s*(\w+)\)")
_KERNELS = re.compile(_MACRO.format(name="CUDIST_KERNELS", params=r"X, A"))
_KERNEL = re.compile(r"\bX\(A,\s*(\w+),\s*(\w+)\)")
_MIXED = re.compile(_MACRO.format(name="CUDIST_MIXED_GRADIENTS", params=r"M, A"))
_MIXED_PAIR = re.compile(r"\bM\(A,\s*(\w+),\s*(\w+)\)")
_RULES = re.compile(_MACRO.format(name="CUDIST_UPDATE_RULE_LIST", params=r"X, A"))
#: The fused all-reduce + update kernels (one per row of the rules' table).
FUSED_PREFIX = "mirrored_all_reduce_"
#: LossScaleOptimizer's reduction kernel: with the fused kernels, the ones CUDIST_MIXED_GRADIENTS
#: also instantiates mixed (kernel_list.cuh's comment on that macro says so).
UNSCALE_KERNEL = "reduce_unscale_finite"
# A row may continue on the next line (``\`` and a newline are blanks to it).
_RULE = re.compile(r"\bX\(A,[\s\\]*(\w+),[\s\\]*(\w+),[\s\\]*\(([^()]*)\),[\s\\]*\(([^()]*)\)\)")


def _names(text: str) -> tuple[str, ...]:
    """The identifiers of a row's parenthesized list (a continued line's ``\\`` a blank to it; ``()``: none)."""
    return tuple(x for x in (x.strip(" \\\n") for x in text.split(",")) if x)


def parse_update_rules(text: str) -> dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """``{name: (rule, slots, hyper-parameters)}`` from the rules' header text, in table order.

    Raises:
        ValueError: the text has no ``CUDIST_UPDATE_RULE_LIST(X, A)`` macro, or it lists no row.
    """
    body = _RULES.search(text)
    if body is None:
        raise ValueError(f"{UPDATE_RULES}: no CUDIST_UPDATE_RULE_LIST(X, A) macro found")
    rows = {
        name: (rule, _names(slots), _names(hyper))
        for name, rule, slots, hyper in _RULE.findall(body.group(1))
    }
    if not rows:
        raise ValueError(f"{UPDATE_RULES}: CUDIST_UPDATE_RULE_LIST lists no rule")
    return rows


def parse_kernel_list(text: str, rules_text: str = "") -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
    """``({kernel: NumPy dtype names}, {NumPy dtype name: C++ type})`` from the header's text.

    Args:
        text: the kernel list header's text.
        rules_text: the update rules' header text: adds ``mirrored_all_reduce_<name>`` for each of
            its rows (none when empty).

    Raises:
        ValueError: the text declares no kernel, or a kernel names an undeclared dtype set.
    """
    sets: dict[str, tuple[tuple[str, str], ...]] = {}
    for m in _DTYPE_SET.finditer(text):
        sets[m.group(1)] = tuple((c.strip(), name) for c, name in _DTYPE.findall(m.group(2)))
    body = _KERNELS.search(text)
    if body is None or not sets:
        raise ValueError(f"{KERNEL_LIST}: no CUDIST_KERNELS(X, A) / CUDIST_DTYPES_<SET>(D, A) macro found")
    kernels: dict[str, tuple[str, ...]] = {}
    for kernel, dset in _KERNEL.findall(body.group(1)):
        if dset not in sets:
            raise ValueError(f"{KERNEL_LIST}: kernel {kernel} names dtype set {dset}, which is not declared")
        kernels[kernel] = tuple(name for _, name in sets[dset])
    if rules_text:
        for rule in parse_update_rules(rules_text):
            kernels[f"mirrored_all_reduce_{rule}"] = tuple(name for _, name in sets[RULE_KERNEL_DTYPES])
    if not kernels:
        raise ValueError(f"{KERNEL_LIST}: CUDIST_KERNELS lists no kernel")
    ctypes = {name: c for entries in sets.values() for c, name in entries}
    return kernels, ctypes


def parse_mixed_gradients(text: str) -> dict[str, tuple[str, ...]]:
    """``{variable dtype: gradient dtypes}`` (NumPy names) from the kernel list's
    ``CUDIST_MIXED_GRADIENTS(M, A)``: the fused kernels' mixed-precision instantiations (none
    without the macro)."""
    body = _MIXED.search(text)
    pairs: dict[str, tuple[str, ...]] = {}
    if body is not None:
        for var, grad in _MIXED_PAIR.findall(body.group(1)):
            pairs[var] = (*pairs.get(var, ()), grad)
    return pairs


def takes_mixed_gradients(kernel: str) -> bool:
    """Whether ``kernel`` of the kernel list also has the mixed-precision instantiations
    ``kernel<T, G>`` of CUDIST_MIXED_GRADIENTS: the fused all-reduce + update kernels and
    LossScaleOptimizer's ``reduce_unscale_finite`` (the kernels that sum gradients for an update)."""
    return kernel.startswith(FUSED_PREFIX) or kernel == UNSCALE_KERNEL


def mixed_gradients(include_dir) -> dict[str, tuple[str, ...]]:
    """Variable dtype -> the narrower gradient dtypes its fused kernels also take (NumPy names)."""
    return dict(parse_mixed_gradients((Path(include_dir) / KERNEL_LIST).read_text()))


@functools.lru_cache(maxsize=None)
def _parsed(include_dir: str) -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
    root = Path(include_dir)
    return parse_kernel_list((root / KERNEL_LIST).read_text(), (root / UPDATE_RULES).read_text())


def kernel_list(include_dir) -> dict[str, tuple[str, ...]]:
    """Every kernel cudist launches -> the NumPy names of the dtypes it is instantiated for.

    Args:
        include_dir: the C++ header directory (:func:`cudist.get_include` for the headers NVRTC
            compiles).
    """
    return dict(_parsed(str(include_dir))[0])


def dtype_ctypes(include_dir) -> dict[str, str]:
    """NumPy dtype name -> the C++ type the kernel templates take (``float16`` -> ``__half``)."""
    return dict(_parsed(str(include_dir))[1])


_ARCH = re.compile(r"(\d+)([af]?)(?:-(real|virtual))?")


def runs_on(architectures: str, compute_capability: int) -> bool:
    """Whether code built for ``architectures`` runs on a GPU of ``compute_capability``.

    Args:
        architectures: CMake's CUDA architectures, comma-separated as ``_core.cuda_architectures``
            reports them ("80,90"; an entry may be suffixed ``-real`` (SASS only) or ``-virtual``
            (PTX only); a plain one has both).
        compute_capability: major * 10 + minor, e.g. 86.

    SASS runs on GPUs of its major version and no older minor one; PTX is compiled by the driver
    for any GPU at least as new; arch-specific builds (``90a``) run on exactly that GPU. CMake's
    ``all``, ``all-major`` and ``native`` are taken at their word.
    """
    cc = int(compute_capability)
    for entry in str(architectures).split(","):
        if entry.strip() in ("all", "all-major", "native"):
            return True
        m = _ARCH.fullmatch(entry.strip())
        if m is None:
            continue
        arch, specific, kind = int(m.group(1)), m.group(2), m.group(3)
        if specific:
            if arch == cc:
                return True
        elif (kind != "virtual" and arch // 10 == cc // 10 and arch <= cc) or (kind != "real" and arch <= cc):
            return True
    return False


def launch_mode() -> str:
    """``CUDIST_CUDA_LAUNCHERS``, validated: ``auto`` (also when unset), ``core`` or ``nvrtc``.

    Raises:
        ValueError: any other value (the message names the variable and the choices).
    """
    return _settings.cuda_launchers()


def launch_policy() -> str:
    """One line on how the CuPy backend will launch its collectives, decided without initialising CUDA
    (``python -m cudist --info``); the loaded backend's ``launch_path`` says what it actually does."""
    try:
        mode = launch_mode()
    except ValueError as e:
        return f"unusable: {e}"
    if mode == "nvrtc":
        return f"NVRTC for every kernel ({LAUNCHERS_ENV}=nvrtc)"
    try:
        from cudist import _core  # noqa: PLC0415 - optional extension
    except ImportError:
        why = "cudist._core is not importable"
    else:
        why = None if getattr(_core, "cuda_built", False) else "cudist._core was built without CUDA"
    if why is not None:
        if mode == "core":
            return f"unusable: {LAUNCHERS_ENV}=core but {why}"
        return f"NVRTC for every kernel ({why})"
    how = "" if mode == "core" else " where its CUDA runtime sees the GPUs and it was built for them (else NVRTC)"
    return f"cudist._core's CUDA launchers for the collectives{how}, NVRTC for the rest ({LAUNCHERS_ENV}={mode})"
