"""Kernels compiled for a Hopper GPU (sm_90) on a machine without one: Triton's whole lowering, through its IRs to
PTX and, with the ptxas its wheel carries, to a cubin, in a fresh process (tests/ops imports the kernel modules in
interpreter mode, whose kernels cannot be compiled). It catches what the interpreter cannot: a construct the GPU
backend does not lower (a layout a reshape or split cannot take, a conversion a store cannot make). It does not
check numbers on a GPU (tests/gpu does).

Listed: the kernels and variants that came without a GPU run behind them (SwiGLU's activation, the RMSNorm passes
with a residual add and its gradient, the gate-up forward in one product, the expert GEMMs loading through tensor
descriptors, the top-k slot sum, KDA's decayed products through each sub-chunk's edge row), beside the default launch
of the kernels they change.
"""

import json
import os
import subprocess
import sys

# One process compiles every case: (module, kernel, constexprs, num_warps, num_stages, argument types other than
# bf16 pointers and i32 scalars).
_COMPILE = r"""
import importlib, inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

for module, kernel, constexprs, num_warps, num_stages, types in json.loads(sys.argv[1]):
    fn = getattr(importlib.import_module(module), kernel)
    signature = {
        name: "constexpr" if name in constexprs else types.get(name, "*bf16" if name.endswith("_ptr") else "i32")
        for name in inspect.signature(fn.fn).parameters
    }
    options = dict(num_warps=num_warps, num_stages=num_stages)
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    print(kernel, json.dumps(constexprs, sort_keys=True), "cubin" if compiled.asm.get("cubin") else "no cubin")
"""

SWIGLU = "moe_tune.ops.swiglu.kernels"
RMS_NORM = "moe_tune.ops.rms_norm.kernels"
MOE_FWD = "moe_tune.ops.moe.kernels_fwd"
MOE_BWD = "moe_tune.ops.moe.kernels_bwd"
MOE_ROUTING = "moe_tune.ops.moe.routing"
KDA = "moe_tune.ops.linear_attention.kernels_kda"
_NORM_TYPES = {"rstd_ptr": "*fp32", "dw_partial_ptr": "*fp32", "eps": "fp32"}
_MOE_TYPES = {"ws_ptr": "*fp32", "xa_ptr": "*fp32", "token_of_row_ptr": "*i32", "tile_expert_ptr": "*i32",
              "tile_row_ptr": "*i32", "offsets_ptr": "*i32", "scaling": "fp32"}  # fmt: skip
_GATE_UP = dict(SCALE_BLOCK=128, HAS_LORA=True, SAVE_GATE_UP=True, DOT_PRECISION="tf32", BLOCK_M=128, BLOCK_N=64,
                BLOCK_K=64, BLOCK_R=16)  # fmt: skip
_TILE = dict(W_IS_FP8=False, SCALE_BLOCK=128, HAS_LORA=True, DOT_PRECISION="tf32", BLOCK_M=128, BLOCK_N=128,
             BLOCK_K=64, BLOCK_R=16)  # fmt: skip
_ROW_TYPES = dict(_MOE_TYPES, slot_of_row_ptr="*i32", ha_ptr="*fp32")
# KDA's products kernels as a bf16 K = V = 128 training call launches them (fp32 decays, scratch and gate sums).
_KDA_TYPES = {name: "*fp32" for name in ("a_ptr", "a_log_ptr", "dt_bias_ptr", "g_cumsum_ptr", "dkk_ptr",
                                         "dk_partial_ptr", "dG_partial_ptr", "dG_last_ptr", "dq_ptr", "dk_ptr",
                                         "dg_ptr", "da_log_partial_ptr", "ddt_bias_partial_ptr")}
_KDA_TYPES.update(chunk_map_ptr="*i32", scale="fp32")
_KDA = dict(USE_L2NORM=True, BT=64, SB=16, BV=64, DOT_PRECISION="tf32", GATE_IN_KERNEL=True, FAST_SPAN=60.0)


def _descriptors(tma: bool, **blocks: list[int]) -> tuple[dict, dict]:
    """(constexprs, argument types) of a kernel's descriptor arguments: bf16 descriptors of `blocks` with TMA, None
    (a constexpr) without."""
    if tma:
        return {}, {name: f"tensordesc<bf16{block}>" for name, block in blocks.items()}
    return dict.fromkeys(blocks), {}


CASES = [
    *[(SWIGLU, "_swiglu_fwd_kernel", dict(HAS_SCALE=scaled, BLOCK_M=16, BLOCK_F=256), 4, 3, {})
      for scaled in (True, False)],
    *[(SWIGLU, "_swiglu_bwd_kernel", dict(HAS_SCALE=scaled, HAS_DSCALE=scaled, BLOCK_M=16, BLOCK_F=256), 4, 3, {})
      for scaled in (True, False)],
    (SWIGLU, "_swiglu_bwd_kernel", dict(HAS_SCALE=True, HAS_DSCALE=False, BLOCK_M=16, BLOCK_F=256), 4, 3,
     {"gate_ptr": "*fp32", "up_ptr": "*fp32", "scale_ptr": "*fp32", "dh_ptr": "*fp32", "dgate_ptr": "*fp32",
      "dup_ptr": "*fp32", "dscale_ptr": "*fp32"}),
    *[(RMS_NORM, "_rms_norm_fwd_kernel", dict(HAS_RESIDUAL=residual, HAS_GATE=False, IS_SILU=True, IS_ONE_PLUS=True,
                                             BLOCK_M=2, BLOCK_N=2048), 4, 3, _NORM_TYPES)
      for residual in (True, False)],
    *[(RMS_NORM, "_rms_norm_bwd_kernel", dict(HAS_GATE=False, IS_SILU=True, IS_ONE_PLUS=True, HAS_DW=True, HAS_DH=dh,
                                             BLOCK_M=2, BLOCK_N=2048), 4, 3, _NORM_TYPES) for dh in (True, False)],
    *[(MOE_FWD, "_moe_gate_up_fwd_kernel", dict(_GATE_UP, W_IS_FP8=False, ONE_DOT=one_dot, **constexprs, TMA=tma), 8,
       3, dict(_MOE_TYPES, **types))
      for one_dot in (False, True) for tma in (False, True)
      for constexprs, types in [_descriptors(tma, w_desc=[1, 2 if one_dot else 1, 64, 64])]],
    (MOE_FWD, "_moe_gate_up_fwd_kernel", dict(_GATE_UP, W_IS_FP8=True, ONE_DOT=True, w_desc=None, TMA=False), 8, 3,
     dict(_MOE_TYPES, w_ptr="*fp8e4nv")),
    (MOE_FWD, "_moe_gate_up_fwd_kernel", dict(_GATE_UP, BLOCK_N=128, W_IS_FP8=False, ONE_DOT=True, TMA=True), 8, 3,
     dict(_MOE_TYPES, w_desc="tensordesc<bf16[1, 2, 128, 64]>")),
    *[(MOE_FWD, "_moe_down_fwd_kernel", dict(_TILE, **constexprs, TMA=tma), 8, 3, dict(_ROW_TYPES, **types))
      for tma in (False, True)
      for constexprs, types in [_descriptors(tma, h_desc=[128, 64], w_desc=[128, 64])]],
    *[(MOE_BWD, "_moe_gate_up_bwd_kernel", dict(_TILE, NUM_HALVES=1, **constexprs, TMA=tma), 8, 3,
       dict(_ROW_TYPES, **types))
      for tma in (False, True)
      for constexprs, types in [_descriptors(tma, g_desc=[128, 64], w_desc=[64, 128])]],
    *[(MOE_BWD, "_moe_down_bwd_gemm_kernel", dict(_TILE, **constexprs, TMA=tma), 8, 3, dict(_ROW_TYPES, **types))
      for tma in (False, True) for constexprs, types in [_descriptors(tma, w_desc=[64, 128])]],
    (MOE_BWD, "_moe_down_bwd_gemm_kernel", dict(_TILE, BLOCK_N=256, TMA=True), 8, 3,
     dict(_ROW_TYPES, w_desc="tensordesc<bf16[64, 256]>")),
    *[(MOE_ROUTING, "_sum_slots_kernel", dict(TOP_K=8, NUM_ADDENDS=num_addends, BLOCK_T=4, BLOCK_D=1024), 8, 3, {})
      for num_addends in (0, 1, 2)],
    (KDA, "_kda_grad_products_tiled_kernel", dict(_KDA, BK=64), 8, 1, _KDA_TYPES),
    (KDA, "_kda_grad_products_kernel", dict(_KDA, BK=128), 8, 1, _KDA_TYPES),
]  # fmt: skip


def test_kernels_compile_to_a_cubin_for_sm90():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(CASES)], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    expected = [f"{kernel} {json.dumps(constexprs, sort_keys=True)} cubin" for _, kernel, constexprs, *_ in CASES]
    assert lines == expected
