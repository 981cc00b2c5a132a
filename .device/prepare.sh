#!/usr/bin/env bash
# Here (no GPU), in the repository root: fetch what the H200 machine lacks, into folders git ignores locally.
#   .whl/        deepspeed (built here, pure Python), hjson, pydantic and its parts: installed by setup.sh
#   .fla/        flash-linear-attention and fla-core: on PYTHONPATH only for runs that should see FLA
#   .tri/        Triton 3.7.1 for Python 3.12, installed and trimmed to fit one run's 64 MiB:
#                libtriton.so without its debug sections (strip --strip-unneeded: 461 -> 180 MB), and without
#                what compiling and launching kernels on the H200 never loads: Proton's profiler and its CUPTI
#                libraries, the Blackwell ptxas, nvdisasm, the AMD backend, FileCheck, the instrumentation and plugin
#                test libraries (about 45 MB of xz)
# Usage: bash .device/prepare.sh [--no-triton]
set -euo pipefail
cd "$(dirname "$0")/.."
for folder in /.whl/ /.fla/ /.tri/; do
    grep -qxF "$folder" .git/info/exclude 2>/dev/null || echo "$folder" >> .git/info/exclude
done
PY=${PYTHON:-python3}
get() {  # get FOLDER NAME==VERSION...: binary wheels for the H200's CPython 3.12 on x86-64
    local folder=$1; shift
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$folder" "$@"
}
rm -rf .whl .fla && mkdir -p .whl .fla
"$PY" -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8
get .whl hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
get .fla flash-linear-attention==0.6.0 fla-core==0.6.0
if [[ "${1:-}" != "--no-triton" ]]; then
    WORK=/tmp/moe-tune-tri
    rm -rf .tri "$WORK" && mkdir -p .tri "$WORK"
    get "$WORK" triton==3.7.1
    "$PY" -m pip install -q --no-deps --no-compile --target "$WORK/site" --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --only-binary=:all: "$WORK"/triton-3.7.1-*.whl
    cd "$WORK/site"
    rm -rf bin triton/_C/libproton.so triton/backends/nvidia/lib/cupti triton/backends/nvidia/bin/ptxas-blackwell \
        triton/backends/nvidia/bin/nvdisasm triton/backends/amd triton/FileCheck triton/instrumentation triton/plugins
    strip --strip-unneeded triton/_C/libtriton.so
    tar cf - triton triton-3.7.1.dist-info | xz -9e -T2 > "$OLDPWD/.tri/triton-3.7.1.tar.xz"
    cd "$OLDPWD"
fi
du -sh .whl .fla .tri 2>/dev/null
