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
# the first failure (tests/test_gpu_kernels.py -x), then the GPU benchmarks, then the rest of the
# gpu/multi_gpu tests (the kernels on the NVRTC path, the strategy tests and the others); every
# step's full log lands in $OUT/logs.tgz and a short summary is printed. GPU_BENCH_MIB (default 256) and
# GPU_BENCH_MAX (default 256M) shrink the benchmarks, e.g. for a dry run under the CuPy emulation:
#   PYTHON=<venv>/bin/python PYTHONPATH=$PWD/tests/emu/fakecupy GPU_BENCH_MIB=1 GPU_BENCH_MAX=64K \
#     bench/gpu_session.sh run
#
# The device tool brings back at most 8 files from $OUT: the logs are written to a work folder and
# packed into $OUT/logs.tgz after every step, so a run stopped at its time limit still returns what
# it did. Each step has a time limit of its own (GPU_STEP_S, default 150 s; SIGINT first, so pytest
# prints where it was), so one hang cannot eat the whole lease.
set -u
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
PY=${PYTHON:-python3}
DEST=${OUT:-/tmp/cudist-gpu-out}
OUT=$(mktemp -d /tmp/cudist-gpu-logs.XXXX)
MIB=${GPU_BENCH_MIB:-256}
MAX=${GPU_BENCH_MAX:-256M}
STEP=${GPU_STEP_S:-150}
# JAX (tests/test_interop.py) must not take 75% of the GPU on import; the C++ build uses every core.
export XLA_PYTHON_CLIENT_PREALLOCATE=false CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export PYTHONUNBUFFERED=1

snapshot() { mkdir -p "$DEST" && tar -C "$OUT" -czf "$DEST/logs.tgz" . 2>/dev/null; }
limit() { timeout -s INT -k 15 "$STEP" "$@"; }

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

kernel_tests() {
  local t0=$SECONDS rc=0
  # The kernels first, stopping at the first failure: if they are wrong nothing above them can pass.
  limit "$PY" -m pytest -q -p no:cacheprovider -x -m "gpu or multi_gpu" tests/test_gpu_kernels.py tests/test_gpu_hazards.py \
    tests/test_cuda_launch_paths.py \
    -rs >"$OUT/gpu-kernel-tests.log" 2>&1 || rc=$?
  snapshot
  echo "gpu kernel tests: rc=$rc, $((SECONDS - t0)) s: $(tail -1 "$OUT/gpu-kernel-tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu-kernel-tests.log" | head -10
  return $rc
}

other_tests() {
  local t0=$SECONDS rc=0
  # The same kernel tests on the other launch path: the default (auto) takes cudist._core's C++
  # launchers for the collectives when the build found nvcc; NVRTC must agree with them.
  t0=$SECONDS
  CUDIST_CUDA_LAUNCHERS=nvrtc limit "$PY" -m pytest -q -p no:cacheprovider -x -m "gpu or multi_gpu" \
    tests/test_gpu_kernels.py tests/test_gpu_hazards.py tests/test_cuda_launch_paths.py -rs \
    >"$OUT/gpu-kernel-tests-nvrtc.log" 2>&1 || rc=$?
  snapshot
  echo "gpu kernel tests (CUDIST_CUDA_LAUNCHERS=nvrtc): rc=$rc, $((SECONDS - t0)) s: $(tail -1 "$OUT/gpu-kernel-tests-nvrtc.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu-kernel-tests-nvrtc.log" | head -10
  t0=$SECONDS
  # (with the mixed-precision apply_gradients checks: bf16/f16 gradients into the fused GPU pass,
  # and LossScaleOptimizer's reduce_unscale_finite kernel)
  limit "$PY" -m pytest -q -p no:cacheprovider -m "gpu or multi_gpu" tests/test_gpu_strategy.py tests/test_strategy.py \
    tests/test_gpu_mixed_fused.py tests/test_gpu_loss_scale.py -rs >"$OUT/gpu-strategy-tests.log" 2>&1 || rc=$?
  snapshot
  echo "gpu strategy tests: rc=$rc, $((SECONDS - t0)) s: $(tail -1 "$OUT/gpu-strategy-tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu-strategy-tests.log" | head -20
  t0=$SECONDS
  limit "$PY" -m pytest -q -p no:cacheprovider -m "gpu or multi_gpu" tests/ -rs \
    --ignore=tests/test_gpu_kernels.py --ignore=tests/test_gpu_hazards.py --ignore=tests/test_cuda_launch_paths.py \
    --ignore=tests/test_gpu_strategy.py --ignore=tests/test_strategy.py --ignore=tests/test_gpu_mixed_fused.py \
    --ignore=tests/test_gpu_loss_scale.py \
    >"$OUT/gpu-tests.log" 2>&1 || rc=$?
  snapshot
  echo "other gpu tests: rc=$rc, $((SECONDS - t0)) s: $(tail -1 "$OUT/gpu-tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -30
  return $rc
}

bench() {
  limit "$PY" bench/gpu_kernels.py --mib "$MIB" --repeats 20 >"$OUT/gpu_kernels.txt" 2>&1
  echo "gpu_kernels rc=$?"; snapshot
  # nccl-tests style sweeps on one GPU (replicas = buffers on device 0), on both launch paths
  # (auto: cudist._core's C++ launchers when built with CUDA; nvrtc: CuPy's RawModule).
  for path in auto nvrtc; do
    for n in 2 4 8; do
      CUDIST_CUDA_LAUNCHERS=$path limit "$PY" -m cudist.bench all-reduce --backend cupy --replicas $n -b 4K -e "$MAX" -f 4 \
        -n 20 -w 5 --no-progress --json "$OUT/all-reduce-$path-n$n.json" >"$OUT/all-reduce-$path-n$n.txt" 2>&1
      echo "cudist-bench all-reduce ($path) N=$n rc=$?"; snapshot
    done
  done
  limit "$PY" -m cudist.bench update --optimizer adamw --backend cupy --replicas 4 -b 4K -e "$MAX" -f 16 --no-progress \
    --json "$OUT/adam.json" >"$OUT/adam.txt" 2>&1
  echo "cudist-bench update adam rc=$?"; snapshot
  cat "$OUT/gpu_kernels.txt"
}

case "${1:-}" in
  prepare) prepare ;;
  run)
    mkdir -p "$OUT"
    nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
    versions
    install || { snapshot; exit 1; }
    snapshot
    case "${2:-all}" in
      tests) kernel_tests; other_tests ;;
      bench) bench ;;
      # The benchmarks before the slower tests: a lease that ends early still brings numbers back.
      all) kernel_tests; bench; other_tests ;;
      *) echo "unknown: ${2}"; exit 2 ;;
    esac
    snapshot
    ;;
  *) sed -n 2,16p "$0"; exit 2 ;;
esac
