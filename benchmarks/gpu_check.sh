#!/usr/bin/env bash
# benchmarks/gpu_check.sh - the whole GPU check in one run, on a machine with an
# NVIDIA GPU (sm_80 or newer; written for the lent H200): builds libibp.so and
# libibp_cuda.so with that machine's compilers, runs the GPU tests with its
# python3 (no torchrec needed), then benchmarks lookups (benchmarks/gpu_lookup.py)
# and prints the benchmark's table last. Stays under 8 minutes (IBP_GPU_CHECK_BUDGET
# seconds, default 470) and timestamps every step.
#
# Run from anywhere:   bash benchmarks/gpu_check.sh
# Through the device tool, with the carried wheels (below):
#   run(command="bash benchmarks/gpu_check.sh 2>&1 | tee $OUT/gpu_check.log", carry=[".whl"])
# When $OUT is set, the log of each step and the table are also written there.
#
# That machine's python3 has torch, numpy, pytest and tqdm but no cffi (nor its
# pycparser), and no network: carry their wheels in .whl/ (ignored by git):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl 'cffi>=2.0' pycparser
# FBGEMM rows of the benchmark run only if fbgemm_gpu imports there (a wheel built
# for that machine's torch would have to be carried); otherwise they are skipped
# with a note.
set -uo pipefail

START=$(date +%s)
BUDGET=${IBP_GPU_CHECK_BUDGET:-470}
PY=${PYTHON:-python3}
ts() { echo "[$(date '+%H:%M:%S') +$(( $(date +%s) - START ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)
LOGDIR=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1
export PATH="$PATH:/usr/local/cuda/bin"

ts "gpu_check in $ROOT (budget ${BUDGET}s, logs in $LOGDIR)"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv,noheader || ts "nvidia-smi failed"
command -v nvcc >/dev/null && nvcc --version | tail -1 || ts "nvcc not found"
$PY -c 'import sys, torch, numpy; print("python", sys.version.split()[0], "| torch", torch.__version__,
"| torch CUDA", torch.version.cuda, "| cuda available", torch.cuda.is_available(), "| numpy", numpy.__version__)'

# ---- carried wheels ----
if ! $PY -c 'import cffi, pycparser' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    ts "installing carried wheels: $(cd .whl && ls *.whl | tr '\n' ' ')"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/ibp_site .whl/*.whl || ts "wheel install failed"
    export PYTHONPATH=/tmp/ibp_site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! $PY -c 'import cffi' 2>/dev/null; then
    ts "FAILED: cffi does not import: carry cffi and pycparser wheels in .whl/ (see this script's header)"
    exit 3
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

# ---- build ----
ts "build: make lib"
if ! timeout 120 make -j"$(nproc)" lib PYTHON="$PY" >"$LOGDIR/build_lib.log" 2>&1; then
    tail -30 "$LOGDIR/build_lib.log"
    ts "FAILED: make lib"
    exit 4
fi
ts "build: make cuda"
rm -f native/build/libibp_cuda.so
if ! timeout 240 make cuda PYTHON="$PY" >"$LOGDIR/build_cuda.log" 2>&1 || [ ! -f native/build/libibp_cuda.so ]; then
    tail -30 "$LOGDIR/build_cuda.log"
    ts "FAILED: make cuda"
    exit 5
fi
ts "built: $(ls -la native/build/libibp.so native/build/libibp_cuda.so | awk '{print $5, $9}' | tr '\n' ' ')"

# ---- GPU tests ----
T=$(( $(left) - 200 )); [ "$T" -gt 180 ] && T=180; [ "$T" -lt 60 ] && T=60
ts "tests: pytest -m gpu (timeout ${T}s)"
timeout "$T" $PY -m pytest -q -m gpu -rs -p no:cacheprovider tests/test_cuda.py tests/test_cache.py \
    2>&1 | tee "$LOGDIR/pytest_gpu.log" | tail -40
TESTS=${PIPESTATUS[0]}
ts "tests finished: exit status $TESTS"

# ---- benchmark ----
T=$(( $(left) - 5 ))
ARGS=()
if [ "$T" -lt 150 ]; then ARGS=(--rows 1000000 --iters 5 --batches 2); fi
ts "benchmark: benchmarks/gpu_lookup.py ${ARGS[*]:-} (timeout ${T}s)"
if [ "$T" -gt 30 ]; then
    timeout "$T" $PY benchmarks/gpu_lookup.py "${ARGS[@]}" --table-out "$LOGDIR/gpu_lookup_table.md" \
        >"$LOGDIR/gpu_lookup.log" 2>&1
    BENCH=$?
    grep -v '^|' "$LOGDIR/gpu_lookup.log" | grep -v '^$' | tail -60
else
    BENCH=124
    ts "no time left for the benchmark"
fi
ts "benchmark finished: exit status $BENCH"

ts "summary: build ok, GPU tests exit $TESTS, benchmark exit $BENCH, $(( $(date +%s) - START ))s in all"
if [ -s "$LOGDIR/gpu_lookup_table.md" ]; then
    echo
    cat "$LOGDIR/gpu_lookup_table.md"
fi
[ "$TESTS" -eq 0 ] && [ "$BENCH" -eq 0 ]
