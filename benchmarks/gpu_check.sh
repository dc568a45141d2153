#!/usr/bin/env bash
# GPU check: the kernel correctness tests (compiled, not interpreted), the kernel micro-benchmark and
# the optimizer benchmark ladder.
#
#   benchmarks/gpu_check.sh OUTDIR          (PYTHON=... picks the interpreter; default python3, else python)
#
# Writes into OUTDIR: env.json (device, versions, commit), kernel_tests.txt + kernel_tests.xml
# (pytest on tests/test_kernels*.py and the other CUDA tests), kernels_bench.json + kernels_bench.txt (torch vs Triton per
# product, Gram NS vs standard NS, fused Dion3 update; medians in ms), ladder.json + ladder.png +
# ladder.txt (benchmarks/ladder.py: step time, FLOPs, bytes, passes, state and transient memory per
# optimizer on the 124M-like, 1B-like and 7B-like matrix sets; 7B-like at 8 of its 32 layers so that
# AdamW's parameters, gradients, state and temporaries fit in memory many times over).
# Runs in under 8 minutes: a first Triton launch (env.json says whether Triton can build its launcher
# here); tests capped at 140 s (capture tests first, then the fused Muon update, then the kernels,
# whose first calls compile and autotune, then the stacked Dion2/Dion3 state on the GPU, then whether
# CUDA's kernels keep μ, lr and decay exact for bf16/fp16 tensors as CPUs do not); the kernel benchmark stops starting new cases after 80 s
# and is stopped at 110 s; the ladder stops starting new rungs after 140 s (each set by its share:
# 124m by 47 s, 1b by 93 s, 7b:8 by 140 s, a set's unspent share passing on; the rest are listed as
# skipped) and is stopped at 180 s. Both benchmarks rewrite their JSON as they go, so a stop keeps
# what was measured (a stop at a cap is reported as such, not as a failure); a stop is SIGINT first,
# so pytest still writes its report and the ladder still prints its table.
# Without a CUDA device (or without triton) it says so and exits 0; without torch it fails.
# Exit status: 0 when every step that ran passed, 1 when the tests failed or could not run (no pytest)
# or a benchmark broke.
set -uo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
export PYTHONUNBUFFERED=1  # output reaches the logs even when a step is stopped at its cap
# Each benchmark picks its backends itself: an inherited ORTHOPTIM_KERNELS=torch would make every rung a
# torch one (TRITON_INTERPRET is unset below, with a message).
unset ORTHOPTIM_KERNELS
# The checkout's own package, installed or not (a GPU image may hold torch and triton but no orthoptim).
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c 'import torch, orthoptim'; then
    echo "gpu_check: $PY cannot import torch and orthoptim (above); set PYTHON=<the interpreter that has torch>" >&2
    exit 2
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device here; nothing to check (exit 0)"
    exit 0
fi
if ! "$PY" -c 'import triton' 2>/dev/null; then
    echo "gpu_check: CUDA is available but triton is not installed (pip install triton); nothing to check (exit 0)"
    exit 0
fi
if [ -n "${TRITON_INTERPRET:-}" ]; then
    echo "gpu_check: unsetting TRITON_INTERPRET=${TRITON_INTERPRET}: this check compiles the kernels"
    unset TRITON_INTERPRET
fi

# env.json, and a first Triton launch: Triton builds its launcher with the host's C compiler and
# Python headers on first use, and without them every kernel would fall back to torch.
"$PY" - "$OUT/env.json" <<'EOF'
import importlib.metadata, json, os, shutil, subprocess, sys, sysconfig, torch, triton
def git(*args):
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()
    except OSError:  # no git on the image
        return ""
def version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
commit = git("rev-parse", "HEAD") or None
dirty = bool(git("status", "--porcelain"))
info = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
        "pytest": version("pytest"), "matplotlib": version("matplotlib"), "quack-kernels": version("quack-kernels"),
        "c_compiler": os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"),
        "python_headers": os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")),
        "commit": commit, "uncommitted_changes": dirty}
sys.path.insert(0, "benchmarks")  # the probe is a file: @triton.jit reads its function's source
from triton_probe import probe
info["triton_launch"] = probe("cuda")
json.dump(info, open(sys.argv[1], "w"), indent=1)
print("gpu_check:", info)
if info["triton_launch"] != "ok":
    print("gpu_check: a first Triton kernel did not run (above; a C compiler and Python.h are needed): the tests "
          "of the Triton kernels will fail and the benchmarks will time the torch fallback")
EOF

status=0
# A benchmark stopped at its cap (timeout's 124) has written what it measured: a stop, not a failure.
bench_status() {  # NAME RC
    if [ "$2" -eq 124 ]; then
        echo "gpu_check: $1 stopped at its time cap; its JSON keeps what it measured"
    elif [ "$2" -ne 0 ]; then
        echo "gpu_check: $1 FAILED (exit $2)"
        status=1
    fi
}
if ! "$PY" -c 'import pytest' 2>/dev/null; then
    echo "gpu_check: pytest is not installed for $PY (pip install pytest): no kernel tests; the benchmarks still run"
    echo "pytest is not installed" > "$OUT/kernel_tests.txt"
    status=1
else
echo "gpu_check: kernel and CUDA-graph capture tests (compiled kernels on $("$PY" -c 'import torch; print(torch.cuda.get_device_name())'))"
timeout -s INT -k 10 140 "$PY" -m pytest -q -p no:cacheprovider tests/test_capture.py tests/test_polar_factors.py \
    tests/test_kernels.py tests/test_kernels_triton.py tests/test_stacked_state.py tests/test_half_precision_updates.py \
    --junitxml "$OUT/kernel_tests.xml" 2>&1 | tee "$OUT/kernel_tests.txt"
test_rc=${PIPESTATUS[0]}
if [ "$test_rc" -ne 0 ]; then
    echo "gpu_check: kernel tests FAILED (exit $test_rc; 124 = timed out)"
    status=1
fi
fi

echo "gpu_check: kernel micro-benchmark"
timeout -s INT -k 10 110 "$PY" benchmarks/kernels_bench.py --out "$OUT/kernels_bench.json" --budget-s 80 2>&1 \
    | tee "$OUT/kernels_bench.txt"
bench_status "kernel benchmark" "${PIPESTATUS[0]}"

echo "gpu_check: optimizer benchmark ladder"
png_args=(--png "$OUT/ladder.png")
if ! "$PY" -c 'import matplotlib' 2>/dev/null; then
    echo "gpu_check: matplotlib is not installed: no ladder.png (pip install matplotlib)"
    png_args=()
fi
timeout -s INT -k 10 180 "$PY" benchmarks/ladder.py --device cuda --sets 124m,1b,7b:8 --warmup 2 --repeats 5 --budget-s 140 \
    --json "$OUT/ladder.json" ${png_args[@]+"${png_args[@]}"} 2>&1 | tee "$OUT/ladder.txt"
bench_status "ladder" "${PIPESTATUS[0]}"

echo "gpu_check: done, results in $OUT (status $status)"
exit $status
