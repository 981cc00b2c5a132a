# On the H200 machine, after `source .device/setup.sh [3.6|3.7.1] [fla]`:
#   bash .device/task.sh TASK [LIMIT_S [ARGS...]]   (ARGS go to the task's command, e.g. `sweep 200 --ops gdn`)
# Each task writes its JSON, plot and log into r/ (named by task, $NAME if set, and Triton version) and stops itself
# at LIMIT_S (SIGINT first, so a benchmark still writes what it measured); the call tars r/ into $OUT at its end.
#   suite         pytest -m gpu tests/gpu -n WORKERS --dist loadgroup -v --durations=40 (each outcome logged as it comes: a run cut at its limit
#                 names what ran), then the tests a lost CUDA context kept from running, in fresh processes (-rerun);
#                 tests that passed in an earlier call on this warm machine at the same tree are left out
#   sweep         python -m moe_tune.engine.bench.linear_attention_sweep (gdn, kda)
#   conv-sweep    python -m moe_tune.engine.bench.causal_conv_sweep
#   anchor        moe-tune profile --kernels --ops gated_delta_rule,kda --shapes anchor
#   next          moe-tune profile bench-qwen3-next
#   turns         moe-tune profile bench-qwen3-next --compare-launch ... (ARGS: the launches, --steps for the rounds)
#   next-against  moe-tune profile bench-qwen3-next --against transformers
#   moe-against   moe-tune profile bench-qwen3-moe --against transformers
#   next-base     moe-tune profile bench-qwen3-next at the commit .base/ holds (bash .device/base.sh COMMIT here; carry
#                 .base), from a copy of the tree under /tmp with that commit's files: ours then and now in one call
set -u
TASK=$1
LIMIT=${2:-540}
shift $(($# < 2 ? $# : 2))
case $TASK in
    suite | sweep | conv-sweep | anchor | next | turns | next-against | moe-against | next-base) ;;
    *) echo "task.sh: unknown task '$TASK': suite, sweep, conv-sweep, anchor, next, turns, next-against, moe-against" \
            "or next-base" >&2
       exit 2 ;;
esac
ROOT=$PWD
# NAME (optional) tells two runs of one task in a call apart: r/TASK-NAME-tritonX.json.
TAG=$TASK${NAME:+-$NAME}-triton$(python3 -c 'import triton; print(triton.__version__)')
mkdir -p r
run() {
    timeout -s INT -k 30 "$LIMIT" "$@" > "$ROOT/r/$TAG.log" 2>&1
    echo "rc=$?" >> "$ROOT/r/$TAG.log"
    tail -25 "$ROOT/r/$TAG.log"
}
case $TASK in
    suite)
        # 8 workers fit in an H200's 141 GB; on an 80 GB H100 some of the suite's tests run out of memory with 8.
        WORKERS=${WORKERS:-$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits |
            awk 'NR == 1 { print ($1 > 100000) ? 8 : 5 }')}
        SUITE=(python3 -m pytest -m gpu -n "${WORKERS:-8}" --dist loadgroup -v -rfE --tb=short --durations=40 -p no:cacheprovider)
        # The tests passed on this machine at this tree (its Python files and profiles) and Triton version: left out,
        # so that a call stopped at its limit is finished by the next call while the machine is warm.
        TREE=$(find . -path ./.git -prune -o -path ./r -prune -o \( -name '*.py' -o -name '*.yaml' \) -type f -print |
            LC_ALL=C sort | xargs md5sum | md5sum | cut -c1-12)
        mkdir -p /tmp/moe-tune-gpu-passed
        export MOE_TUNE_GPU_PASSED=/tmp/moe-tune-gpu-passed/$TREE-$TAG.txt
        export MOE_TUNE_GPU_RERUN=r/$TAG.rerun
        run "${SUITE[@]}" tests/gpu "$@"
        # The tests a lost CUDA context kept from running (tests/gpu/conftest.py), once more in fresh processes.
        if [[ -s $MOE_TUNE_GPU_RERUN ]] && ((LIMIT - SECONDS > 30)); then
            mapfile -t IDS < "$MOE_TUNE_GPU_RERUN"
            LIMIT=$((LIMIT - SECONDS))
            TAG=$TAG-rerun
            export MOE_TUNE_GPU_RERUN=r/$TAG.rerun
            run "${SUITE[@]}" "${IDS[@]}"
        fi ;;
    sweep) run python3 -m moe_tune.engine.bench.linear_attention_sweep "r/$TAG.json" "$@" ;;
    conv-sweep) run python3 -m moe_tune.engine.bench.causal_conv_sweep "r/$TAG.json" "$@" ;;
    anchor) run python3 -m moe_tune profile --kernels --ops gated_delta_rule,kda --shapes anchor \
        --json "r/$TAG.json" --plot "r/$TAG.png" "$@" ;;
    next) run python3 -m moe_tune profile bench-qwen3-next --json "r/$TAG.json" --plot "r/$TAG.png" "$@" ;;
    turns) run python3 -m moe_tune profile bench-qwen3-next --json "r/$TAG.json" "$@" ;;
    next-against) run python3 -m moe_tune profile bench-qwen3-next --against transformers \
        --json "r/$TAG.json" --plot "r/$TAG.png" "$@" ;;
    moe-against) run python3 -m moe_tune profile bench-qwen3-moe --against transformers \
        --json "r/$TAG.json" --plot "r/$TAG.png" "$@" ;;
    next-base)
        [[ -f .base/COMMIT ]] || { echo "task.sh next-base: carry .base (bash .device/base.sh COMMIT here)" >&2; exit 2; }
        BASE_COMMIT=$(cat .base/COMMIT)
        BASE=/tmp/moe-tune-base-$BASE_COMMIT
        TAG=next-base-$BASE_COMMIT-${TAG##*-}
        rm -rf "$BASE" && mkdir -p "$BASE" && cp -r ops engine cli profiles moe_tune setup.cfg "$BASE"/
        cp -r .base/files/. "$BASE"/
        while read -r path; do rm -f "$BASE/$path"; done < .base/REMOVED
        # The base's package on the path in place of the tree's (setup.sh puts the tree last).
        (cd "$BASE" && PYTHONPATH=${PYTHONPATH%:"$ROOT"}:$BASE MOE_TUNE_COMMIT=$BASE_COMMIT \
            run python3 -m moe_tune profile bench-qwen3-next --json "$ROOT/r/$TAG.json" "$@") ;;
esac
