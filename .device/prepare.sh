#!/usr/bin/env bash
# Here (no GPU), in the repository root: fetch what the H200 machine lacks, into folders git ignores locally.
#   .whl/        deepspeed (built here, pure Python), hjson, pydantic and its parts: installed by setup.sh
#   .fla/        flash-linear-attention and fla-core: on PYTHONPATH only for runs that should see FLA
#   .tri1..4/    Triton 3.7.1 for Python 3.12 in four parts (197 MB; a run carries at most 64 MiB)
# Usage: bash .device/prepare.sh [--no-triton]
set -euo pipefail
cd "$(dirname "$0")/.."
for folder in /.whl/ /.fla/ /.tri1/ /.tri2/ /.tri3/ /.tri4/; do
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
    rm -rf .tri1 .tri2 .tri3 .tri4 /tmp/moe-tune-tri && mkdir -p /tmp/moe-tune-tri
    get /tmp/moe-tune-tri triton==3.7.1
    split -n 4 -d /tmp/moe-tune-tri/triton-3.7.1-*.whl /tmp/moe-tune-tri/part
    for i in 0 1 2 3; do mkdir -p .tri$((i + 1)) && mv /tmp/moe-tune-tri/part0$i .tri$((i + 1))/; done
fi
du -sh .whl .fla .tri? 2>/dev/null
