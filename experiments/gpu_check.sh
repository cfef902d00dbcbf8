#!/usr/bin/env bash
# The device check (docs/gpu.md, "Running the device check"): on a GPU machine without network
# (Python, CuPy, NumPy, h5py and PyTorch installed; no MPI, maybe no mpi4py), from this source
# tree, within GPU_CHECK_SECONDS (540 by default), everything included:
#   1. installs mpi4py, MPICH and the few pure-Python packages the tests need from the wheels
#      `make gpu-wheels` downloaded into experiments/gpu_wheels (run it where there is network,
#      and carry that git-ignored folder): pip install --no-index --no-deps --target DEPS, the
#      mpich wheel's mpich-*.data/data unpacked, its bin on PATH, its lib on LD_LIBRARY_PATH;
#   2. makes zmpi importable from the source tree in every Python process, the tests' children
#      too (they set PYTHONPATH themselves): a .pth file in this Python's site-packages, removed
#      at the end, puts DEPS and the tree first on sys.path and maps zmpi.models to models/ as
#      pyproject's package-dir does;
#   3. runs, each step under its own limit (STEPS below), the GPU-marked tests (pytest with
#      PYTEST_DISABLE_PLUGIN_AUTOLOAD=1, the plugins it needs named with -p: the image's own
#      pytest plugins stay out), experiments/bench_gpu.py (GPT-2 small at micro-batches 8 and
#      16, fp16 at stages 0 and 3, bf16 at stage 0, PyTorch eager beside it, zmpi plan's
#      prediction beside each), experiments/bench_flash_attention.py (the attention core,
#      blocked, flash and SDPA), experiments/gpu_trace.py (the step's kernels by GPU time; and a
#      small model's GPU idle time, the most a CUDA graph of its step could save, which decides
#      the graph plan: docs/gpu.md) and bench_gpu.py's torch.compile peer (bf16, micro-batch 8),
#      and beside them, on one CPU core, experiments/bench_gpu.py --count (the stand-in's
#      launches; any machine);
#   4. writes targets.md: issue 48's targets against what was measured (gpu_targets.py).
# What it leaves in $OUT (default results/gpu_check; an earlier run's files there are removed
# first) is three files, what the device tool brings back (at most 8 files, 2 folders deep):
# summary.txt (each step passed, failed (exit code), or skipped (no GPU; no C compiler for
# torch.compile; the budget spent), its time and limit, and the budget's arithmetic),
# targets.md, and results.tar.gz, every step's log and results folder (written at the exit,
# whatever stopped the check; a file over 8 MiB is left out of it, and summary.txt says so).
# The steps' limits, each with its kill grace, and the reserve for the install and the
# packing add up to the default budget (summary.txt's first line does the sum); a step that
# finds less than 20 s left (a smaller GPU_CHECK_SECONDS, a slow install) is skipped for the
# budget, which is no failure. Exit 0 when every step that ran passed, 1 otherwise (and when
# the wheels are missing).
#
# GPU_CHECK_DRY_RUN=1 runs the same script on any machine without installing or running
# anything: every step as on a GPU, its command written to its log instead of run (the wheels
# and the GPU not looked for), then the packing: what would come back. tests/test_gpu_check.py
# runs it in `make test`.
#
#   bash experiments/gpu_check.sh          # or: make gpu-check; on the device tool:
#       run(command="bash experiments/gpu_check.sh", carry=["experiments/gpu_wheels"],
#           timeout_s=600)                 # $OUT is the tool's
#   GPU_WHEELS=DIR GPU_DEPS=DIR OUT=DIR PYTHON=python3 GPU_CHECK_SECONDS=540 (defaults)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WHEELS=${GPU_WHEELS:-experiments/gpu_wheels}
DEPS=${GPU_DEPS:-${TMPDIR:-/tmp}/zmpi-gpu-deps}
PY=${PYTHON:-python3}
OUT=${OUT:-results/gpu_check}
BUDGET=${GPU_CHECK_SECONDS:-540}
DRY=${GPU_CHECK_DRY_RUN:-0}
if ! [[ $BUDGET =~ ^[0-9]+$ && $DRY =~ ^[01]$ ]]; then
    echo "gpu_check: GPU_CHECK_SECONDS=$BUDGET GPU_CHECK_DRY_RUN=$DRY: want whole seconds, and 0 or 1"
    exit 2
fi
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
# this run's results only: a step that does not run or finish must not leave an earlier run's
rm -rf "$OUT"/{summary.txt,targets.md,results.tar.gz}
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
RESULTS=$(mktemp -d "${TMPDIR:-/tmp}/zmpi-gpu-check.XXXXXX") || exit 1  # the tarball's
failed=0

# STEPS: name, limit (s), in the order they run; count runs beside the others, on the CPU
STEPS="env:25 tests:150 bench:100 flash:55 trace:45 trace-small:25 compile:65"
COUNT_LIMIT=300
GRACE=5       # timeout -k: a step that ignores SIGTERM is killed this much later
RESERVE=40    # the install before the steps, gpu_targets.py and the packing after them
PACK_MB=8     # a results file larger than this stays out of the tarball (the tool's: 16 MiB)
limit_of() { local s; for s in $STEPS; do [[ ${s%%:*} == "$1" ]] && echo "${s#*:}"; done; }
planned=$RESERVE
for s in $STEPS; do planned=$((planned + ${s#*:} + GRACE)); done
DEADLINE=$((SECONDS + BUDGET - RESERVE / 2))  # the last half of the reserve: after the steps

note() { printf '%s\n' "$*" | tee -a "$SUMMARY"; }

# results.tar.gz of $RESULTS (run at the exit, however the check ends)
pack() {
    local big
    big=$(cd "$RESULTS" && find . -type f -size +$((PACK_MB * 1024))k | sed 's|^\./||')
    if [[ -n $big ]]; then
        note "left out of results.tar.gz (over $PACK_MB MiB): $(echo $big)"
    fi
    tar -C "$RESULTS" -czf "$OUT/results.tar.gz" \
        $(for f in $big; do printf -- '--exclude=./%s ' "$f"; done) . \
        || note "gpu_check: could not write $OUT/results.tar.gz"
    rm -rf "$RESULTS"
}
trap 'exit 143' TERM INT
trap 'pack' EXIT

n_steps=$(echo $STEPS | wc -w)
note "$(printf 'budget      %d s: steps %d s + %d x %d s kill grace + %d s install and packing = %d s%s' \
    "$BUDGET" $((planned - RESERVE - n_steps * GRACE)) "$n_steps" "$GRACE" "$RESERVE" \
    "$planned" "$( ((planned > BUDGET)) && echo ', over the budget: the last steps may be skipped')")"

# step NAME LOG CMD...: CMD's output into $RESULTS/LOG, at most NAME's limit (and never past the
# deadline), its status and time in summary.txt; skipped (not failed) when the budget is spent
step() {
    local name=$1 log=$2 limit left=$((DEADLINE - SECONDS)) start=$SECONDS rc
    shift 2
    limit=$(limit_of "$name")
    limit=${limit:-$COUNT_LIMIT}
    if ((left < 20)); then
        note "$(printf '%-11s skipped: the %s s budget is spent' "$name" "$BUDGET")"
        return
    fi
    if ((DRY)); then
        printf 'dry run, %d s: %s\n' "$limit" "$*" > "$RESULTS/$log"
        note "$(printf '%-11s dry run %4d s limit  %s' "$name" "$limit" "$log")"
        return
    fi
    timeout -k $GRACE $((limit < left ? limit : left)) "$@" > "$RESULTS/$log" 2>&1
    rc=$?
    if ((rc == 0)); then
        note "$(printf '%-11s ok      %4d s of %d  %s' "$name" $((SECONDS - start)) "$limit" "$log")"
    else
        failed=1
        note "$(printf '%-11s FAILED  %4d s of %d  %s (exit %d%s)' "$name" $((SECONDS - start)) \
            "$limit" "$log" "$rc" "$( ((rc == 124)) && echo ', timed out')")"
    fi
}

# -- 1, 2: the dependencies, from the carried wheels ------------------------------------------
if ((DRY)); then
    note "install     dry run: the wheels in $WHEELS not looked for, nothing installed"
elif ! ls "$WHEELS"/mpi4py-*.whl "$WHEELS"/mpich-*.whl > /dev/null 2>&1; then
    note "gpu_check: no mpi4py and mpich wheels in $WHEELS: run 'make gpu-wheels' on a machine" \
        "with network (PYTHON_VERSION=3.12 by default) and carry that folder here"
    exit 1
else
    rm -rf "$DEPS" && mkdir -p "$DEPS/site" || exit 1
    wheels=$(ls "$WHEELS"/*.whl | grep -v '/mpich-')
    # shellcheck disable=SC2086  # one argument per wheel
    if ! "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --target \
            "$DEPS/site" $wheels > "$RESULTS/install.txt" 2>&1; then
        note "gpu_check: the wheels in $WHEELS do not install for $("$PY" -V 2>&1) (built for" \
            "another Python?): install.txt in results.tar.gz"
        exit 1
    fi
    PTH=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zmpi_gpu_check.pth
    trap 'rm -f "$PTH"; pack' EXIT
    "$PY" - "$WHEELS" "$DEPS/mpich" "$DEPS/site" "$REPO" "$PTH" <<'PYTHON' || exit 1
"""Unpack the mpich wheel's mpich-*.data/data (bin/, lib/, ...) keeping the files' modes; write
the module that maps zmpi.models to the source tree's models/ and the .pth that loads it."""
import sys
import zipfile
from pathlib import Path

wheels, mpich, site, repo, pth = map(Path, sys.argv[1:])
wheel = sorted(wheels.glob("mpich-*.whl"))[-1]
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        parts = Path(info.filename).parts
        if len(parts) > 2 and parts[0].endswith(".data") and parts[1] == "data" \
                and not info.is_dir():
            target = mpich.joinpath(*parts[2:])
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(info))
            mode = info.external_attr >> 16
            if mode:
                target.chmod(mode & 0o777)
if not (mpich / "bin" / "mpiexec").exists():
    sys.exit(f"gpu_check: {wheel.name} has no mpich-*.data/data/bin/mpiexec")
(site / "zmpi_gpu_check_models.py").write_text(f'''"""zmpi.models is {repo}/models (pyproject's
package-dir mapping, which a source tree on sys.path lacks). Written by experiments/gpu_check.sh."""
import importlib.util
import sys

class _ZmpiModels:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "zmpi.models":
            return None
        return importlib.util.spec_from_file_location(
            name, "{repo}/models/__init__.py", submodule_search_locations=["{repo}/models"])

sys.meta_path.append(_ZmpiModels)
''')
try:  # one line: a .pth runs a line that starts with "import"
    pth.write_text(f"import sys; sys.path[:0] = [{str(site)!r}, {str(repo)!r}]; "
                   "import zmpi_gpu_check_models\n")
except OSError as e:
    sys.exit(f"gpu_check: cannot write {pth} ({e.strerror}): run it as the Python's owner")
PYTHON
    export PATH="$DEPS/mpich/bin:$PATH"
    export LD_LIBRARY_PATH="$DEPS/mpich/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
revision="not a git checkout"
if git rev-parse --git-dir > /dev/null 2>&1; then
    revision=$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' with uncommitted changes')
fi
note "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ), $revision, $("$PY" -V 2>&1)"

env_report() {  # what runs here: fails if zmpi, mpi4py or mpiexec does not work
    set -e
    "$PY" -c 'import sys, numpy, mpi4py, zmpi, zmpi.models.gpt
from mpi4py import MPI
print("python", sys.version.split()[0], "numpy", numpy.__version__, "mpi4py", mpi4py.__version__)
print("zmpi from", zmpi.__file__, "and", zmpi.models.gpt.__file__)
print(MPI.Get_library_version().splitlines()[0])'
    mpiexec -n 2 "$PY" -c 'from mpi4py import MPI; print("rank", MPI.COMM_WORLD.rank, "of 2")'
    "$PY" -c 'import cupy; print("cupy", cupy.__version__, cupy.cuda.runtime.getDeviceCount(), "GPUs")' || true
    "$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.cuda.is_available())' || true
    nvidia-smi || true
}
export -f env_report
export PY
step env env.txt bash -c env_report

# -- 3: the checks (the count, on the CPU, beside the GPU's) -------------------------------------
# at T 1024, so that it cuts attention as the trace's GPT-2 small at micro-batch 8 (two query
# blocks) and the two counts compare (about 3 minutes on one core)
(step count count.txt env ZMPI_BACKEND=numpy "$PY" experiments/bench_gpu.py --count \
    --seq-len 1024 --out "$RESULTS/count"; exit $failed) &
counting=$!
if ((DRY)) || "$PY" -c "import cupy, sys; sys.exit(cupy.cuda.runtime.getDeviceCount() == 0)" \
        2> /dev/null; then
    # the test files that hold GPU-marked tests, or tests on the cuda_device fixture (its "gpu"
    # case is marked; the other files may need what this machine lacks); the image's pytest
    # plugins (xdist, cov, benchmark, ...) not loaded, the ones the suite needs named
    tests=$(grep -l 'mark\.gpu\|cuda_device' tests/test_*.py)
    # shellcheck disable=SC2086
    step tests tests.txt env ZMPI_BACKEND=cupy PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PY" -m pytest \
        -q -p pytest_timeout -p no:cacheprovider -m gpu $tests
    step bench bench.txt env ZMPI_BACKEND=cupy mpiexec -n 1 "$PY" experiments/bench_gpu.py \
        --no-count --batch 8 16 --stages 0 3 --warmup 2 --steps 5 --out "$RESULTS/bench"
    # the attention core and a GPT step with the flash kernels (tensor cores in fp16 from sm_80)
    step flash flash.txt env ZMPI_BACKEND=cupy mpiexec -n 1 "$PY" \
        experiments/bench_flash_attention.py --warmup 2 --steps 5 --out "$RESULTS/flash"
    step trace trace.txt env ZMPI_BACKEND=cupy mpiexec -n 1 "$PY" experiments/gpu_trace.py \
        --out "$RESULTS/trace"
    # a small model, where launches may bind: the GPU's idle time, what a CUDA graph could save
    step trace-small trace_small.txt env ZMPI_BACKEND=cupy mpiexec -n 1 "$PY" \
        experiments/gpu_trace.py --n-layer 4 --d-model 256 --n-head 4 --seq-len 128 --batch 4 \
        --out "$RESULTS/trace_small"
    # the issue's stretch peer, last: torch.compile's first steps compile (about a minute;
    # Triton builds its launchers with the host's C compiler)
    if ! ((DRY)) && ! command -v cc gcc clang > /dev/null; then
        note "compile     skipped: no C compiler (cc, gcc or clang) for torch.compile's Triton"
    else
        step compile compile.txt env ZMPI_BACKEND=cupy mpiexec -n 1 "$PY" \
            experiments/bench_gpu.py --no-count --stages --bf16-stages --peers compile \
            --batch 8 --warmup 3 --steps 5 --out "$RESULTS/compile"
    fi
else
    for name in tests bench flash trace trace-small compile; do
        note "$(printf '%-11s skipped: no GPU (CuPy sees none)' "$name")"
    done
fi
wait $counting || failed=1
# issue 48's targets against what was measured ("-" where a step did not run or finish)
if "$PY" experiments/gpu_targets.py "$RESULTS" > /dev/null 2> "$RESULTS/targets.txt"; then
    cp "$RESULTS/targets.md" "$OUT/targets.md"
    cat "$OUT/targets.md"
else
    note "targets     FAILED: experiments/gpu_targets.py (targets.txt in results.tar.gz)"
    failed=1
fi
note "results in $OUT: summary.txt, targets.md, results.tar.gz (every step's log and folder)"
exit $failed
