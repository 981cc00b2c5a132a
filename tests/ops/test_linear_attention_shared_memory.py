"""Shared memory of the fp32 linear-attention kernels as launched on an H200 (sm_90), found on the CPU.

A launch whose kernel needs more shared memory than the device has fails on the GPU (OutOfResources). Here the
kernel path runs on CPU tensors with the GPU launch configuration and every `_*_kernel` replaced by a recorder; each
distinct launch is then specialized as JITFunction.run does and compiled for sm_90 through Triton's stages up to its
shared-memory allocation (engine/bench/kernel_compile.py: record_call, distinct, shared_memory), whose "ttg.shared"
is the size Triton launches with. It runs in a subprocess without TRITON_INTERPRET: under the interpreter
@triton.jit builds interpreted functions, which Triton cannot compile.

Cases: fp32 K 128, V 64 (the output-writing state pass) and V 128 (the state-storing pass and the output kernel),
per-head decay and KDA, forward and backward: the fp32 variants with the most shared memory among those the GPU tests
launch (K over 128 does not fit in fp32, ops/linear_attention/README.md).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

# The H200's (sm_90) shared memory per block, as Triton's OutOfResources reports it: 227 KB.
H200_SHARED_MEMORY = 232448
# The kernels the fp32 cases launch: a recorder that saw fewer missed the kernel path.
FP32_KERNELS = {
    "_chunk_wy_fwd_kernel", "_chunk_state_fwd_kernel", "_chunk_output_kernel", "_prepare_state_bwd_kernel",
    "_chunk_state_bwd_kernel", "_chunk_grad_output_kernel", "_chunk_grad_state_kernel", "_chunk_grad_wy_kernel",
    "_chunk_grad_wy_tiled_kernel", "_chunk_grad_output_state_kernel", "_kda_pairs_kernel",
    "_kda_grad_products_tiled_kernel",
    "_kda_wy_fwd_kernel", "_kda_grad_wy_kernel", "_kda_grad_products_kernel",
}  # fmt: skip
REPO = Path(__file__).resolve().parents[2]


def test_fp32_launches_fit_the_h200_shared_memory():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    # A Triton without the compiler internals used below (the CPU set-up pins one that has them) fails here too.
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert {row["kernel"] for row in rows} == FP32_KERNELS
    # The fp32 dots are the 3xTF32 ones the GPU runs (DOT_PRECISION, INV_PRECISION, INV_DOTS).
    precisions = {
        value for row in rows for name, value in row["constexprs"].items() if "PRECISION" in name or "DOTS" in name
    }
    assert precisions == {"tf32x3"}
    # The split's WY kernel: one key tile at the gradient kernels' warps, tiles of 64 at its own count (4).
    from moe_tune.ops.linear_attention.kernels_common import GPU_NUM_WARPS_GRAD

    tiled = {
        (row["constexprs"]["BK"], row["num_warps"]) for row in rows if row["kernel"] == "_chunk_grad_wy_tiled_kernel"
    }
    assert tiled == {(128, GPU_NUM_WARPS_GRAD), (64, 4)}
    fused = {row["constexprs"]["BK"] for row in rows if row["kernel"] == "_chunk_grad_output_state_kernel"}
    assert fused == {64, 128}
    over = [row for row in rows if row["shared"] > H200_SHARED_MEMORY]
    assert not over, "\n".join(json.dumps(row) for row in over)


def _record_and_measure() -> None:
    import torch

    from moe_tune.engine.bench import kernel_compile

    # The per-head backward five ways: its WY kernel whole, with the state part split off (split_grad_wy), then in
    # key tiles of 64 (block_k_grad_wy) at 4 warps of its own (num_warps_grad_wy), with the state part in the
    # output kernel in key tiles of 64 (grad_state_in_output, block_k_grad_output), and pick_config's choice.
    tiled = {"split_grad_wy": True, "grad_state_in_output": False, "block_k_grad_wy": 64, "num_warps_grad_wy": 4}
    splits = (
        {"split_grad_wy": False}, {"split_grad_wy": True, "grad_state_in_output": False, "block_k_grad_wy": None,
                                   "num_warps_grad_wy": None}, tiled,
        dict(tiled, grad_state_in_output=True, block_k_grad_output=64), {},
    )  # fmt: skip
    # KDA with its products kernel in pick_config's key tiles of 64, in tiles of 32 and whole
    # (block_k_kda_grad_products).
    kda = ({}, {"block_k_kda_grad_products": 32}, {"block_k_kda_grad_products": None})
    cases = [(False, split) for split in splits] + [(True, overrides) for overrides in kda]
    launches = []
    for V, (is_kda, split) in itertools.product((64, 128), cases):
        launches += kernel_compile.record_call(is_kda, torch.float32, (128, V), split, save_intermediates=False,
                                               use_qk_l2norm=False, with_states=True)  # fmt: skip
    for launch, source, options, backend, constants in kernel_compile.distinct(launches):
        print(json.dumps(dict(
            kernel=launch.name, shared=kernel_compile.shared_memory(source, options, backend),
            num_warps=options.num_warps, num_stages=options.num_stages,
            constexprs={k: v for k, v in constants.items() if isinstance(v, (bool, int, float, str))},
        )), flush=True)  # fmt: skip


if __name__ == "__main__":
    _record_and_measure()
