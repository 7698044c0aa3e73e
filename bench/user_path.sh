#!/usr/bin/env bash
# The user's-path measurements in one go, each output in its own file under OUTDIR:
#
#   user_path.txt/.json     cudist-bench user-path: strategy.run + all_reduce and apply_gradients
#                           (SGD momentum, Adam) next to the bare kernels, the NumPy loop, TF's
#                           strategy.run in tf.function and the copy ceiling; 256K, 4M, 64M x 4 replicas
#   step.txt/.json          cudist-bench step: the kernel-level step next to the user's path (4 replicas)
#   step_compare.txt/.json  bench/step_compare.py: the MLP 784-512-512-10 step, 1/2/4 replicas, cudist
#                           against TF MirroredStrategy and torch DDP (gloo, 127.0.0.1) / plain torch, and
#                           (with mpi4py) cudist MultiWorkerMirroredStrategy in N processes
#   workers.txt/.json       cudist-bench all-reduce --workers 2: run+all_reduce across 2 MPI workers
#                           against raw mpi4py Allreduce in the same job (with mpi4py)
#   env.txt                 the commit, the machine's load, cudist --info
#
# Usage: bench/user_path.sh OUTDIR [--tf-python PATH] [--torch-python PATH] [--quick]
#
# Run it with the venv that has cudist installed active (or PYTHON=/path/to/python). TensorFlow and
# torch come from --tf-python / --torch-python, else $CUDIST_BENCH_TF_PYTHON /
# $CUDIST_BENCH_TORCH_PYTHON, else the first of a few usual places whose python imports them;
# without one, that peer's rows are skipped (said in the output). --quick: a few rounds only, to
# check the script itself (numbers not for the record). Takes several minutes on 2 cores.
set -euo pipefail

usage() { echo "usage: $0 OUTDIR [--tf-python PATH] [--torch-python PATH] [--quick]" >&2; exit 2; }
[ $# -ge 1 ] || usage
out=$1; shift
tf_python=${CUDIST_BENCH_TF_PYTHON:-}
torch_python=${CUDIST_BENCH_TORCH_PYTHON:-}
quick=0
while [ $# -gt 0 ]; do
  case $1 in
    --tf-python) tf_python=${2:?}; shift 2 ;;
    --torch-python) torch_python=${2:?}; shift 2 ;;
    --quick) quick=1; shift ;;
    *) usage ;;
  esac
done

here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python}
mkdir -p "$out"

# A python that imports $1, from the given path or the usual places; empty if none.
find_python() {
  local module=$1 given=$2; shift 2
  local p
  for p in "$given" "$@"; do
    [ -n "$p" ] && [ -x "$p" ] || continue
    if TF_CPP_MIN_LOG_LEVEL=3 "$p" -c "import $module" >/dev/null 2>&1; then echo "$p"; return; fi
  done
}
tf_python=$(find_python tensorflow "$tf_python" /work/peers/tf/bin/python /tmp/tfvenv/bin/python)
torch_python=$(find_python torch "$torch_python" /work/peers/torch/bin/python /tmp/torchvenv/bin/python)

if [ $quick = 1 ]; then
  up_args=(-n 2 -w 1); sc_args=(--rounds 1 --steps 3 --warmup 1 --settle 3); step_args=(-n 3 -w 1)
else
  up_args=(-n 10 -w 2); sc_args=(--rounds 5); step_args=(-n 20 -w 3)
fi
tf_args=(); [ -n "$tf_python" ] && tf_args=(--compare tf --tf-python "$tf_python")
sc_peers=(); [ -n "$tf_python" ] && sc_peers+=(--tf-python "$tf_python")
[ -n "$torch_python" ] && sc_peers+=(--torch-python "$torch_python")
have_mpi=0; "$py" -c "import mpi4py" >/dev/null 2>&1 && have_mpi=1
[ $have_mpi = 1 ] && sc_peers+=(--workers)

# Runs a command, its output (command line first) into $out/$1.txt.
record() {
  local name=$1; shift
  echo "== $name: $*" >&2
  { echo "\$ $*"; date -u; uptime; "$@"; } >"$out/$name.txt" 2>&1 || echo "   ($name exited $?; see $out/$name.txt)" >&2
}

{
  echo "commit: $(git -C "$here/.." rev-parse HEAD 2>/dev/null || echo unknown)$(git -C "$here/.." diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)')"
  echo "python: $("$py" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  echo "tensorflow python: ${tf_python:-none}"
  echo "torch python: ${torch_python:-none}"
  date -u; uptime
  "$py" -m cudist --info || true
} >"$out/env.txt" 2>&1

record user_path "$py" -m cudist.bench user-path -b 256K -e 64M -f 16 --replicas 4 "${up_args[@]}" \
  "${tf_args[@]}" --no-progress --json "$out/user_path.json"
record step "$py" -m cudist.bench step --replicas 4 "${step_args[@]}" --no-progress --json "$out/step.json"
record step_compare "$py" "$here/step_compare.py" --replicas 1,2,4 "${sc_args[@]}" "${sc_peers[@]}" \
  --json "$out/step_compare.json"
if [ $have_mpi = 1 ]; then
  if [ $quick = 1 ]; then w_args=(-b 4K -e 64K -f 16 -n 5); else w_args=(-b 4K -e 64M -f 4 -n 40); fi
  record workers "$py" -m cudist.bench all-reduce --workers 2 "${w_args[@]}" --no-progress --json "$out/workers.json"
fi
echo "outputs in $out: $(cd "$out" && ls | tr '\n' ' ')" >&2
