"""Shared memory of the fp32 linear-attention kernels as launched on an H200 (sm_90), found on the CPU.

A launch whose kernel needs more shared memory than the device has fails on the GPU (OutOfResources). Here the
kernel path runs on CPU tensors with the GPU launch configuration and every `_*_kernel` replaced by a recorder; each
distinct launch is then specialized as JITFunction.run does and compiled for sm_90 through Triton's stages up to its
shared-memory allocation (make_ir, ttir, ttgir and make_llir's passes through allocate_shared_memory_nv), whose
"ttg.shared" is the size Triton launches with. It runs in a subprocess without TRITON_INTERPRET: under the
interpreter @triton.jit builds interpreted functions, which Triton cannot compile.

Cases: fp32 K 128, V 64 (the output-writing state pass) and V 128 (the state-storing pass and the output kernel),
per-head decay and KDA, forward and backward: the fp32 variants with the most shared memory among those the GPU tests
launch (K over 128 does not fit in fp32, ops/linear_attention/README.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
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
    import types

    import torch

    try:
        from triton._C.libtriton import ir, nvidia, passes
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import get_ptx_version_from_options
        from triton.compiler.compiler import ASTSource, make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature
    except ImportError as error:
        sys.exit(f"this Triton lacks the compiler internals the measurement uses: {error}")

    from moe_tune.ops.linear_attention import (
        autograd,
        kernels_bwd,
        kernels_common,
        kernels_kda,
        kernels_output,
        kernels_state,
        kernels_wy,
    )

    launches = []

    class Recorder:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, self.fn, args, kwargs))

    for module in (kernels_wy, kernels_state, kernels_output, kernels_bwd, kernels_kda):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction) and re.fullmatch(r"_\w+_kernel", name):
                setattr(module, name, Recorder(name, value))
    gpu = kernels_common.pick_config(types.SimpleNamespace(is_cuda=True))

    # The per-head backward five ways: its WY kernel whole, with the state part split off (split_grad_wy), then in
    # key tiles of 64 (block_k_grad_wy) at 4 warps of its own (num_warps_grad_wy), with the state part in the
    # output kernel in key tiles of 64 (grad_state_in_output, block_k_grad_output), and pick_config's choice.
    tiled = {"split_grad_wy": True, "grad_state_in_output": False, "block_k_grad_wy": 64, "num_warps_grad_wy": 4}
    splits = (
        {"split_grad_wy": False}, {"split_grad_wy": True, "grad_state_in_output": False, "block_k_grad_wy": None,
                                   "num_warps_grad_wy": None}, tiled,
        dict(tiled, grad_state_in_output=True, block_k_grad_output=64), {},
    )  # fmt: skip
    # KDA with its products kernel whole and in key tiles of 32 (block_k_kda_grad_products).
    cases = [(False, split) for split in splits] + [(True, {}), (True, {"block_k_kda_grad_products": 32})]
    for V, (is_kda, split) in itertools.product((64, 128), cases):
        autograd.pick_config = lambda x, split=split: dataclasses.replace(gpu, **split)
        B, T, H, K = 1, 130, 4, 128
        q, k = torch.zeros(B, T, H, K), torch.zeros(B, T, H, K)
        v, beta = torch.zeros(B, T, H, V), torch.zeros(B, T, H)
        g = torch.zeros(B, T, H, K) if is_kda else torch.zeros(B, T, H)
        initial_state = torch.zeros(B, H, K, V)
        leaves = [x.requires_grad_() for x in (q, k, v, g, beta, initial_state)]
        o, final_state = autograd.gated_delta_rule_kernel(q, k, v, g, beta, None, initial_state, True)
        torch.autograd.grad([o, final_state], leaves, [torch.zeros_like(o), torch.zeros_like(final_state)])

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    seen = set()
    for name, fn, args, kwargs in launches:
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        kwargs = dict(kwargs, debug=False)
        bound_args, specialization, options = binder(*args, **kwargs)
        key = repr((name, specialization, sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
        src = ASTSource(fn, signature, constexprs, attrs)
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        module = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                             context)  # fmt: skip
        stages = {}
        backend.add_stages(stages, options, src.language)
        metadata = {"hash": name, "target": target, **options.__dict__}
        module = stages["ttgir"](stages["ttir"](module, metadata), metadata)
        # make_llir's passes up to the shared-memory allocation, which sets "ttg.shared" (metadata["shared"]).
        pm = ir.pass_manager(module.context)
        passes.ttgpuir.add_combine_tensor_select_and_if(pm)
        passes.ttgpuir.add_allocate_warp_groups(pm)
        passes.convert.add_scf_to_cf(pm)
        passes.gluon.add_inliner(pm)
        nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(
            pm, target.arch, get_ptx_version_from_options(options, target.arch)
        )
        pm.run(module, "shared_memory")
        names = [p.name for p in fn.params]
        constants = {names[path[0]]: value for path, value in constexprs.items()}
        print(json.dumps(dict(
            kernel=name, shared=module.get_int_attr("ttg.shared"), num_warps=options.num_warps,
            num_stages=options.num_stages,
            constexprs={k: v for k, v in constants.items() if isinstance(v, (bool, int, float, str))},
        )), flush=True)  # fmt: skip


if __name__ == "__main__":
    _record_and_measure()
