#!/usr/bin/env bash
# Everything a session with a lent GPU runs, in as few device calls as possible.
#
#   bench/gpu_session.sh prepare     # here (has a registry): wheels of the dependencies the GPU image lacks
#   bench/gpu_session.sh run [what]  # on the GPU machine (device tool, carry [".gpu-wheels"]);
#                                    # what = all (default) | tests | bench
#
# `run` installs cudist with the image's Python (which has CuPy, scikit-build-core, pybind11, nvcc),
# runs the gpu/multi_gpu tests and the GPU benchmarks, writes full logs under $OUT (the device tool
# brings that folder back) and prints a short summary last. GPU_BENCH_MIB (default 256) and
# GPU_BENCH_MAX (default 256M) shrink the benchmarks, e.g. for a dry run under the CuPy emulation:
#   PYTHON=<venv>/bin/python PYTHONPATH=$PWD/tests/emu/fakecupy GPU_BENCH_MIB=1 GPU_BENCH_MAX=64K \
#     bench/gpu_session.sh run
set -u
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/cudist-gpu-out}
MIB=${GPU_BENCH_MIB:-256}
MAX=${GPU_BENCH_MAX:-256M}

prepare() {
  mkdir -p "$WHEELS"
  # The GPU image (Python 3.12, x86-64) has numpy and numba but not these.
  python -m pip download optree greenlet --python-version 3.12 --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS"
}

install() {
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" optree greenlet >"$OUT/deps.log" 2>&1 ||
    { echo "installing the carried wheels failed:"; tail -20 "$OUT/deps.log"; return 1; }
  local t0=$SECONDS
  "$PY" -m pip install -v --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1 ||
    { echo "building cudist failed:"; tail -40 "$OUT/build.log"; return 1; }
  echo "build: $((SECONDS - t0)) s"
  (cd /tmp && "$PY" -m cudist --info) | tee "$OUT/info.txt"
}

tests() {
  local t0=$SECONDS
  "$PY" -m pytest -q -p no:cacheprovider -m "gpu or multi_gpu" tests/ -rs >"$OUT/gpu-tests.log" 2>&1
  local rc=$?
  echo "gpu tests: rc=$rc, $((SECONDS - t0)) s: $(tail -1 "$OUT/gpu-tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -30
  return $rc
}

bench() {
  "$PY" bench/gpu_kernels.py --mib "$MIB" --repeats 20 >"$OUT/gpu_kernels.txt" 2>&1
  echo "gpu_kernels rc=$?"
  # nccl-tests style sweeps on one GPU (replicas = buffers on device 0).
  for n in 2 4 8; do
    "$PY" -m cudist.bench all-reduce --backend cupy --replicas $n -b 4K -e "$MAX" -f 4 -n 20 -w 5 --no-progress \
      --json "$OUT/all-reduce-n$n.json" >"$OUT/all-reduce-n$n.txt" 2>&1
    echo "cudist-bench all-reduce N=$n rc=$?"
  done
  "$PY" -m cudist.bench update --optimizer adam --backend cupy --replicas 4 -b 4K -e "$MAX" -f 16 --no-progress \
    --json "$OUT/adam.json" >"$OUT/adam.txt" 2>&1
  echo "cudist-bench update adam rc=$?"
  cat "$OUT/gpu_kernels.txt"
}

case "${1:-}" in
  prepare) prepare ;;
  run)
    mkdir -p "$OUT"
    nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
    install || exit 1
    case "${2:-all}" in
      tests) tests ;;
      bench) bench ;;
      all) tests; bench ;;
      *) echo "unknown: ${2}"; exit 2 ;;
    esac
    ;;
  *) sed -n 2,13p "$0"; exit 2 ;;
esac
