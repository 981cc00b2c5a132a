# On the H200 machine, sourced at the start of a run's command (carry: [".whl", ".fla", ".tri"]):
# `source .device/setup.sh [3.6|3.7.1] [fla]`.
#   3.6 (default): the image's Triton; 3.7.1: .tri's archive (.device/prepare.sh), unpacked into /tmp/tri371
#   fla: flash-linear-attention importable (transformers then runs it; on Triton 3.6 its gated backward refuses)
# moe-tune runs from the working tree (PYTHONPATH, no install); MOE_TUNE_COMMIT names the commit for the JSON rows.
TRITON_VERSION=${1:-3.6}
WITH_FLA=${2:-}
if [[ ! -d /tmp/site/deepspeed ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || return 1
fi
if [[ -n "$WITH_FLA" && ! -d /tmp/fla/fla ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla .fla/*.whl || return 1
fi
SITE=/tmp/site
if [[ "$TRITON_VERSION" == "3.7.1" ]]; then
    if [[ ! -d /tmp/tri371/triton ]]; then
        [[ -f .tri/triton-3.7.1.tar.xz ]] || { echo "Triton 3.7.1: carry .tri (.device/prepare.sh)" >&2; return 1; }
        mkdir -p /tmp/tri371 && tar xJf .tri/triton-3.7.1.tar.xz -C /tmp/tri371 || return 1
    fi
    SITE=/tmp/tri371:$SITE
    # The archive holds the NVIDIA backend alone (prepare.sh): backends found in its tree, not through the entry
    # points of every Triton installed (the image's lists AMD's).
    export TRITON_BACKENDS_IN_TREE=1
fi
[[ -n "$WITH_FLA" ]] && SITE=$SITE:/tmp/fla
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
# One compile cache for the machine's calls, autotuning timings included (FLA autotunes every kernel on first use:
# transformers' first step took 164 s on 2026-12-04), per Triton version.
export TRITON_CACHE_DIR=/tmp/tcache-$TRITON_VERSION TRITON_CACHE_AUTOTUNING=1
export MOE_TUNE_COMMIT=${MOE_TUNE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
