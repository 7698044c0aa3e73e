"""The rules' driver keeps its per-element loop a vectorized loop under GCC (issue #27).

GCC's early complete unrolling peels a 16-trip loop with a small body before the loop vectorizer
sees it, and the SLP vectorizer then leaves the peeled copies mostly scalar (momentum ran 1.4-1.6x
slower that way, and which rules were hit moved with unrelated code under LTO). The driver's loop
carries ``#pragma GCC unroll 4`` for rules with slots (see ``fused_rule_update`` in updates.hpp and
bench/PERFORMANCE.md). This compiles the driver for a few such rules with ``-fopt-info-vec`` and
checks that GCC reports that loop vectorized, and no peeled copy of the rule's body.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "csrc" / "include" / "cudist" / "updates.hpp"

_TU = r"""
#include <cudist/updates.hpp>
using namespace cudist;
template <template <class, class> class Rule, std::size_t NS, class... H>
void run(float* const* const (&s)[NS], const float* const* g, std::size_t n, std::size_t count, H... h) {
  detail::run_rule<Rule>(s, n, count, g, 4, 0.0, nullptr, h...);
}
void all(float* const* w, float* const* a, float* const* b, const float* const* g, std::size_t n, std::size_t count) {
  float* const* const two[2] = {a, w};
  float* const* const three[3] = {a, b, w};
  run<rules::momentum>(two, g, n, count, 0.01, 0.9);
  run<rules::nesterov>(two, g, n, count, 0.01, 0.9);
  run<rules::adam>(three, g, n, count, 0.001, 0.9, 0.999, 1e-7);
}
"""


def _gcc() -> str | None:
    cxx = shutil.which("g++")
    if cxx is None:
        return None
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    return cxx if "Free Software Foundation" in out else None  # (a clang behind the name)


def _lines(text: list[str], start: str, end: str) -> range:
    """1-based lines from the one containing ``start`` to the next one that is ``end`` (stripped)."""
    a = next(i for i, line in enumerate(text) if start in line)
    b = next(i for i in range(a + 1, len(text)) if text[i].strip() == end)
    return range(a + 1, b + 2)


@pytest.mark.heavy
@pytest.mark.skipif(not HEADER.is_file(), reason="no source tree")
def test_the_rule_loop_is_vectorized_not_peeled(tmp_path):
    cxx = _gcc()
    if cxx is None:
        pytest.skip("the pragma and the report are GCC's; no g++")
    src = tmp_path / "driver.cpp"
    src.write_text(_TU)
    proc = subprocess.run(
        [cxx, "-std=c++17", "-O3", "-fno-math-errno", "-ffp-contract=off", f"-I{HEADER.parent.parent}",
         "-fopt-info-vec-optimized", "-c", str(src), "-o", str(tmp_path / "driver.o")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    text = HEADER.read_text().splitlines()
    body = _lines(text, "auto element = [&](std::size_t k) {", "};")
    loop = _lines(text, "#pragma GCC unroll 4", "for (std::size_t k = 0; k < L; ++k) element(k);")[-1]
    reports = [
        (int(m.group(1)), m.group(2))
        for m in re.finditer(r"updates\.hpp:(\d+):\d+: optimized: (.*)", proc.stderr)
    ]
    assert any(line == loop and "loop vectorized" in what for line, what in reports), proc.stderr
    peeled = [(line, what) for line, what in reports if line in body and "basic block" in what]
    assert not peeled, peeled
