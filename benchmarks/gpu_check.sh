#!/usr/bin/env bash
# benchmarks/gpu_check.sh - the whole GPU check in one run on a machine with an NVIDIA
# GPU (sm_80 or newer; written for the lent H200: Python 3.12, torch 2.11+cu130, numpy,
# pytest, hypothesis, nvcc 13, compute-sanitizer; no cffi, pycparser, torchrec or
# fbgemm; no network). Steps, each timestamped, within IBP_GPU_CHECK_BUDGET seconds
# (default 470, under 8 minutes):
#   1. install the wheels carried in .whl/ (cffi and pycparser needed; torchrec,
#      fbgemm-gpu-cpu, tensordict, pyvers optional: the TorchRec GPU tests run only
#      where `import torchrec` then works, else the log says why they were skipped);
#   2. build libibp.so and libibp_cuda.so with that machine's compilers, without
#      -Werror (`make WERROR=`: its gcc may warn where CI's does not);
#   3. the GPU tests: pytest -m gpu tests/test_cuda_gpu.py (+ tests/test_torchrec_cuda.py);
#   4. compute-sanitizer memcheck and racecheck on a small case (benchmarks/gpu_sanitize.py);
#   5. the benchmark (benchmarks/gpu_lookup.py), its table printed last.
# Exit status 0 only if every step passed.
#
# Usage:
#   bash benchmarks/gpu_check.sh                   # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run         # anywhere: the steps that need no GPU
#       (wheel list, no-Werror build, GPU tests collected and skipped with their reason,
#       the sanitizer driver and the benchmark through the host emulation)
#   bash benchmarks/gpu_check.sh --download-wheels # here, with network: fetch the cp312
#       manylinux wheels into .whl/ (ignored by git; about 8 MB, well under the 64 MiB
#       the device tool carries with the working tree)
# Through the device tool, from the repository root here:
#   run(command="bash benchmarks/gpu_check.sh 2>&1 | tee $OUT/gpu_check.log",
#       carry=[".whl"], timeout_s=540)
# With $OUT set, each step's log, the benchmark's table (markdown) and JSON land there
# too (7 files with the tee'd log: the tool returns at most 8).
set -uo pipefail

MODE=full
case "${1:-}" in
    --dry-run) MODE=dry ;;
    --download-wheels) MODE=download ;;
    ""|--full) ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (--dry-run, --download-wheels, --help)"; exit 64 ;;
esac

START=$(date +%s)
BUDGET=${IBP_GPU_CHECK_BUDGET:-470}
ts() { echo "[$(date '+%H:%M:%S') +$(( $(date +%s) - START ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)
if [ -z "${PYTHON:-}" ] && [ "$MODE" != full ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PATH="$PATH:/usr/local/cuda/bin"

# Wheels for the GPU machine's python3 (3.12): name==version, one version of each.
WHEELS_NEEDED=(cffi==2.1.1 pycparser==3.12)
# TorchRec and what it needs that the GPU machine lacks (it has torchmetrics, tqdm,
# pyre-extensions, typing-inspect, mypy-extensions, cloudpickle, lightning-utilities).
# fbgemm-gpu-cpu 1.6.0 is the release of torch 2.11's generation; whether TorchRec
# imports with it there is checked at run time, not assumed.
WHEELS_TORCHREC=(torchrec==1.8.0 fbgemm-gpu-cpu==1.6.0 tensordict==0.15.3 pyvers==0.2.3)

if [ "$MODE" = download ]; then
    mkdir -p .whl
    for spec in "${WHEELS_NEEDED[@]}" "${WHEELS_TORCHREC[@]}"; do
        name=${spec%%==*}
        # one version of each: drop others of that name first
        find .whl -maxdepth 1 -iname "$(echo "$name" | tr - _)-*.whl" ! -iname "*-${spec##*==}-*" -delete
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
            -d .whl "$spec" 2>&1 | grep -v '^WARNING: Location' || true
    done
    ls -la .whl
    size=$(du -sm .whl | cut -f1)
    echo "wheels: ${size} MiB in .whl/ (the working tree and carried paths travel in 64 MiB)"
    git check-ignore -q .whl/x.whl && echo ".whl/ is ignored by git" || echo "WARNING: .whl/ is not ignored by git"
    [ "$size" -lt 48 ]
    exit $?
fi

LOGDIR=${OUT:-$(mktemp -d)}
FAIL=()
ts "gpu_check ($MODE) in $ROOT, budget ${BUDGET}s, logs in $LOGDIR"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv,noheader 2>/dev/null || ts "nvidia-smi: no GPU visible"
command -v nvcc >/dev/null && nvcc --version | tail -1 || ts "nvcc not found"
"$PY" -c 'import sys, torch, numpy; print("python", sys.version.split()[0], "| torch", torch.__version__,
"| torch CUDA", torch.version.cuda, "| cuda available", torch.cuda.is_available(), "| numpy", numpy.__version__)'

# ---- 1. carried wheels ----
WHEELS=$(ls .whl/*.whl 2>/dev/null | tr '\n' ' ')
ts "wheels in .whl/: ${WHEELS:-none}"
if [ "$MODE" = full ]; then
    if [ -n "$WHEELS" ]; then
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target /tmp/ibp_site .whl/*.whl; then
            export PYTHONPATH=/tmp/ibp_site${PYTHONPATH:+:$PYTHONPATH}
        else
            ts "wheel install failed"
        fi
    fi
    if ! "$PY" -c 'import cffi, pycparser' 2>/dev/null; then
        ts "FAILED: cffi/pycparser do not import: carry their wheels (bash benchmarks/gpu_check.sh --download-wheels here, then carry=[\".whl\"])"
        exit 3
    fi
else
    for spec in "${WHEELS_NEEDED[@]}"; do
        ls .whl/"$(echo "${spec%%==*}" | tr - _)"-*.whl >/dev/null 2>&1 ||
            ts "dry run: $spec is not in .whl/ (bash benchmarks/gpu_check.sh --download-wheels)"
    done
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
if OUTPUT=$("$PY" -c 'import torchrec, fbgemm_gpu' 2>&1); then
    TORCHREC=1 TORCHREC_ERR=""
    ts "torchrec and fbgemm_gpu import: the TorchRec GPU tests run"
else
    TORCHREC=0 TORCHREC_ERR=$(echo "$OUTPUT" | grep -v '^\s*$' | tail -1)
    ts "TorchRec part SKIPPED: import torchrec, fbgemm_gpu failed: $TORCHREC_ERR"
fi

# ---- 2. build ----
ts "build: make lib cuda WERROR= (no -Werror on this machine's compilers)"
[ "$MODE" = full ] && rm -f native/build/libibp_cuda.so
if ! { timeout 150 make -j"$(nproc)" lib WERROR= && timeout 240 make cuda WERROR=; } >"$LOGDIR/build.log" 2>&1; then
    tail -30 "$LOGDIR/build.log"
    ts "FAILED: build"
    exit 4
fi
if [ ! -f native/build/libibp_cuda.so ]; then
    tail -5 "$LOGDIR/build.log"
    ts "FAILED: no libibp_cuda.so (nvcc missing?)"
    exit 5
fi
ts "built: $(ls -la native/build/libibp.so native/build/libibp_cuda.so | awk '{print $5, $9}' | tr '\n' ' ')"

# ---- 3. GPU tests ----
TESTS=(tests/test_cuda_gpu.py)  # the gpu-marked tests of the CUDA path (not the TorchRec ones)
if [ ! -f tests/test_torchrec_cuda.py ]; then
    ts "tests/test_torchrec_cuda.py does not exist: TorchRec GPU tests not run"
elif [ "$TORCHREC" = 1 ]; then
    TESTS+=(tests/test_torchrec_cuda.py)
else
    ts "tests/test_torchrec_cuda.py SKIPPED: torchrec does not import here ($TORCHREC_ERR)"
fi
T=$(( $(left) - 270 )); [ "$T" -gt 200 ] && T=200; [ "$T" -lt 60 ] && T=60
ts "tests: pytest -m gpu ${TESTS[*]} (timeout ${T}s)"
timeout "$T" "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider "${TESTS[@]}" >"$LOGDIR/pytest_gpu.log" 2>&1
RC_TESTS=$?
grep -E "passed|failed|error|skipped|SKIPPED|FAILED|ERROR" "$LOGDIR/pytest_gpu.log" | tail -40
if [ "$MODE" = dry ] && [ "$RC_TESTS" = 0 ]; then
    grep -q "SKIPPED.*no CUDA device" "$LOGDIR/pytest_gpu.log" && ts "dry run: the GPU tests skip with their reason"
fi
[ "$RC_TESTS" = 0 ] || FAIL+=("GPU tests (exit $RC_TESTS$([ "$RC_TESTS" = 124 ] && echo ', timed out'))")
ts "tests finished: exit status $RC_TESTS"

# ---- 4. compute-sanitizer on a small case ----
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
: >"$LOGDIR/sanitizer.log"
if [ "$MODE" = dry ]; then
    ts "sanitizer: dry run: the driver through the host emulation (no compute-sanitizer without a GPU)"
    "$PY" benchmarks/gpu_sanitize.py --emulate >>"$LOGDIR/sanitizer.log" 2>&1 || FAIL+=("sanitizer driver (emulated)")
    tail -2 "$LOGDIR/sanitizer.log"
elif [ -z "$SAN" ]; then
    ts "FAILED: compute-sanitizer not found"
    FAIL+=("compute-sanitizer missing")
else
    for tool in memcheck racecheck; do
        T=$(( $(left) - 160 )); [ "$T" -gt 100 ] && T=100
        if [ "$T" -lt 30 ]; then ts "no time left for $tool"; FAIL+=("$tool: no time"); continue; fi
        ts "sanitizer: $tool (timeout ${T}s)"
        echo "==== compute-sanitizer --tool $tool" >>"$LOGDIR/sanitizer.log"
        timeout "$T" "$SAN" --tool "$tool" --error-exitcode 9 --print-limit 30 \
            "$PY" benchmarks/gpu_sanitize.py >>"$LOGDIR/sanitizer.log" 2>&1
        rc=$?
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Hazard|Invalid|FAILED|every result" "$LOGDIR/sanitizer.log" | tail -6
        [ "$rc" = 0 ] || FAIL+=("$tool (exit $rc$([ "$rc" = 124 ] && echo ', timed out'))")
        ts "$tool finished: exit status $rc"
    done
fi

# ---- 5. the benchmark, last ----
ARGS=()
if [ "$MODE" = dry ]; then
    ARGS=(--emulate)
else
    T=$(( $(left) - 10 ))
    if [ "$T" -lt 200 ]; then ARGS=(--rows 500000 --timed-batches 4 --warm-batches 4 --repeats 3); fi
    if [ "$T" -lt 100 ]; then ARGS=(--rows 200000 --bags 4096 --timed-batches 2 --warm-batches 2 --repeats 2 --skip-host-gather); fi
fi
T=$(( $(left) - 5 )); [ "$MODE" = dry ] && T=300
RC_BENCH=124
if [ "$T" -gt 30 ]; then
    ts "benchmark: benchmarks/gpu_lookup.py ${ARGS[*]:-} (timeout ${T}s)"
    timeout "$T" "$PY" -m benchmarks.gpu_lookup "${ARGS[@]}" --results-dir "$LOGDIR" \
        --table-out "$LOGDIR/gpu_lookup_table.md" >"$LOGDIR/gpu_lookup.log" 2>&1
    RC_BENCH=$?
    grep -v '^|' "$LOGDIR/gpu_lookup.log" | grep -v '^$' | tail -60
else
    ts "no time left for the benchmark"
fi
[ "$RC_BENCH" = 0 ] || FAIL+=("benchmark (exit $RC_BENCH$([ "$RC_BENCH" = 124 ] && echo ', timed out'))")
ts "benchmark finished: exit status $RC_BENCH"

ts "summary ($MODE): build ok; GPU tests exit $RC_TESTS; TorchRec tests $([ "$TORCHREC" = 1 ] && echo run || echo "skipped ($TORCHREC_ERR)"); benchmark exit $RC_BENCH; $(( $(date +%s) - START ))s in all"
[ ${#FAIL[@]} -eq 0 ] && ts "all steps passed" || ts "FAILED: ${FAIL[*]}"
if [ -s "$LOGDIR/gpu_lookup_table.md" ]; then
    echo
    cat "$LOGDIR/gpu_lookup_table.md"
fi
[ ${#FAIL[@]} -eq 0 ]
