#!/usr/bin/env bash
# Everything a session with a lent GPU runs, in as few device calls as possible.
#
#   bench/gpu_session.sh prepare     # here (has a registry): wheels of the dependencies the GPU image lacks
#   bench/gpu_session.sh run [what]  # on the GPU machine (device tool, carry [".gpu-wheels"]);
#                                    # what = all (default) | tests | bench
#
# `run` first records the versions that decide whether CUDA works at all (nvidia-smi, the driver's
# CUDA, CuPy and the CUDA it was built for, NVRTC, NCCL: versions.txt), then installs cudist with the
# image's Python (which has CuPy, scikit-build-core, pybind11, nvcc), runs the kernel tests stopping at
# the first failure (tests/test_gpu_kernels.py -x), then the rest of the gpu/multi_gpu tests (the
# strategy tests and the others), then the GPU benchmarks; every step's full log stays under $OUT
# (the device tool brings that folder back) and a short summary is printed last. GPU_BENCH_MIB (default 256) and
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

versions() {
  # Before anything else: a driver too old for CuPy's CUDA fails every later step the same way.
  {
    echo "# nvidia-smi"
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap --format=csv 2>&1 || echo "nvidia-smi failed"
    nvidia-smi topo -m 2>&1 | head -20
    echo "# python: $("$PY" --version 2>&1) ($PY)"
    "$PY" - <<'PYEOF' 2>&1
import importlib
try:
    cupy = importlib.import_module("cupy")
except Exception as e:
    print(f"cupy: not importable ({type(e).__name__}: {e})")
else:
    rt = cupy.cuda.runtime
    def fmt(v): return f"{v // 1000}.{v % 1000 // 10}"
    print(f"cupy {cupy.__version__}, built for CUDA {fmt(rt.runtimeGetVersion())}, driver supports CUDA {fmt(rt.driverGetVersion())}")
    try:
        print(f"GPUs: {rt.getDeviceCount()}")
    except Exception as e:
        print(f"GPUs: counting failed: {e}")
    try:
        from cupy_backends.cuda.libs import nvrtc
        print(f"nvrtc {'.'.join(map(str, nvrtc.getVersion()))}")
    except Exception as e:
        print(f"nvrtc: {e}")
    try:
        from cupy.cuda import nccl
        print(f"nccl available={nccl.available}" + (f" version={nccl.get_version()}" if nccl.available else ""))
    except Exception as e:
        print(f"nccl: {e}")
PYEOF
    command -v nvcc >/dev/null && nvcc --version | tail -2
  } >"$OUT/versions.txt" 2>&1
  cat "$OUT/versions.txt"
}

tests() {
  local t0=$SECONDS rc=0
  # The kernels first, stopping at the first failure: if they are wrong nothing above them can pass.
  "$PY" -m pytest -q -p no:cacheprovider -x -m "gpu or multi_gpu" tests/test_gpu_kernels.py tests/test_gpu_hazards.py \
    tests/test_cuda_launch_paths.py \
    -rs >"$OUT/gpu-kernel-tests.log" 2>&1 || rc=$?
  echo "gpu kernel tests: rc=$rc, $((SECONDS - t0)) s: $(tail -1 "$OUT/gpu-kernel-tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu-kernel-tests.log" | head -10
  # The same kernel tests on the other launch path: the default (auto) takes cudist._core's C++
  # launchers for the collectives when the build found nvcc; NVRTC must agree with them.
  t0=$SECONDS
  CUDIST_CUDA_LAUNCHERS=nvrtc "$PY" -m pytest -q -p no:cacheprovider -x -m "gpu or multi_gpu" \
    tests/test_gpu_kernels.py tests/test_gpu_hazards.py tests/test_cuda_launch_paths.py -rs \
    >"$OUT/gpu-kernel-tests-nvrtc.log" 2>&1 || rc=$?
  echo "gpu kernel tests (CUDIST_CUDA_LAUNCHERS=nvrtc): rc=$rc, $((SECONDS - t0)) s: $(tail -1 "$OUT/gpu-kernel-tests-nvrtc.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu-kernel-tests-nvrtc.log" | head -10
  t0=$SECONDS
  "$PY" -m pytest -q -p no:cacheprovider -m "gpu or multi_gpu" tests/test_gpu_strategy.py tests/test_strategy.py \
    -rs >"$OUT/gpu-strategy-tests.log" 2>&1 || rc=$?
  echo "gpu strategy tests: rc=$rc, $((SECONDS - t0)) s: $(tail -1 "$OUT/gpu-strategy-tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu-strategy-tests.log" | head -20
  t0=$SECONDS
  "$PY" -m pytest -q -p no:cacheprovider -m "gpu or multi_gpu" tests/ -rs \
    --ignore=tests/test_gpu_kernels.py --ignore=tests/test_gpu_hazards.py --ignore=tests/test_cuda_launch_paths.py \
    --ignore=tests/test_gpu_strategy.py --ignore=tests/test_strategy.py >"$OUT/gpu-tests.log" 2>&1 || rc=$?
  echo "other gpu tests: rc=$rc, $((SECONDS - t0)) s: $(tail -1 "$OUT/gpu-tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -30
  return $rc
}

bench() {
  "$PY" bench/gpu_kernels.py --mib "$MIB" --repeats 20 >"$OUT/gpu_kernels.txt" 2>&1
  echo "gpu_kernels rc=$?"
  # nccl-tests style sweeps on one GPU (replicas = buffers on device 0), on both launch paths
  # (auto: cudist._core's C++ launchers when built with CUDA; nvrtc: CuPy's RawModule).
  for path in auto nvrtc; do
    for n in 2 4 8; do
      CUDIST_CUDA_LAUNCHERS=$path "$PY" -m cudist.bench all-reduce --backend cupy --replicas $n -b 4K -e "$MAX" -f 4 \
        -n 20 -w 5 --no-progress --json "$OUT/all-reduce-$path-n$n.json" >"$OUT/all-reduce-$path-n$n.txt" 2>&1
      echo "cudist-bench all-reduce ($path) N=$n rc=$?"
    done
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
    versions
    install || exit 1
    case "${2:-all}" in
      tests) tests ;;
      bench) bench ;;
      all) tests; bench ;;
      *) echo "unknown: ${2}"; exit 2 ;;
    esac
    ;;
  *) sed -n 2,16p "$0"; exit 2 ;;
esac
